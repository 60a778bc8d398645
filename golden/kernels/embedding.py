"""K1 lookup_embedding: token rows of the embedding, replicated into the hyper-connection streams."""
from __future__ import annotations

from twin.abi.errors import AbiError


def lookup_embedding(input_ids, embed_weight, *, cfg, nm):
    """input_ids [T] -> (hidden_states [T, D] (bf16 values), x_hc [T, HC, D] f32)."""
    xp = nm.xp
    ids = xp.asarray(input_ids)
    if nm.is_numpy and ids.size and (ids.min() < 0 or ids.max() >= embed_weight.shape[0]):
        bad = ids[(ids < 0) | (ids >= embed_weight.shape[0])][0]
        raise AbiError("input_ids", int(bad), f"token ids in [0, {embed_weight.shape[0]})", where="lookup_embedding")
    hidden = nm.asf(embed_weight[ids])
    x_hc = xp.broadcast_to(hidden[:, None, :], (hidden.shape[0], cfg.hc_mult, hidden.shape[1]))
    return hidden, xp.array(x_hc)
