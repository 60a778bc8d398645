"""K27 on device: the per-lease DSpark state (state_tokens, state_meta) of one TP group's replica,
read by the prepare, advanced by the acceptance and the draft commit.

state_tokens[lease] = [current token, draft_1..draft_7]; state_meta[lease] = [valid, generation,
anchor_position, committed_count, draft_count, position_limit], anchor_position the position of
the current (not yet cached) token.  A stream slot is live when its lease is >= 0, the slot valid
and its generation the staged one; any other slot verifies nothing (width 0).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from twin.abi import constants as C

VALID, GENERATION, ANCHOR, COMMITTED, DRAFTS, LIMIT = range(len(C.STATE_META_FIELDS))
W = C.DECODE_SEQ
K = C.DSPARK_QUERY_WIDTH


@dataclass
class Prepared:
    """Per stream slot: the lease read, liveness, the 8 verify rows' ids and positions, the
    active width (draft_count + 1 when the window fits, else 1; 0 when not live), the anchor,
    the effective draft count and the position limit."""

    lease: torch.Tensor
    live: torch.Tensor
    tokens: torch.Tensor
    positions: torch.Tensor
    width: torch.Tensor
    anchor: torch.Tensor
    drafts: torch.Tensor
    limit: torch.Tensor

    @property
    def rows_live(self) -> torch.Tensor:
        """[n, 8]: the verify rows that publish KV and get a logit row."""
        return torch.arange(W, device=self.width.device)[None, :] < self.width[:, None]


def prepare(tokens, meta, slot_ids, generations) -> Prepared:
    """tokens [64, 8], meta [64, 6] (one replica); slot_ids / generations [n] the staged descriptors."""
    lease = torch.clamp(slot_ids.long(), min=0)
    m = meta[lease].long()
    live = (slot_ids >= 0) & (m[:, VALID] == 1) & (m[:, GENERATION] == generations.long())
    anchor, dc, lim = m[:, ANCHOR], m[:, DRAFTS], m[:, LIMIT]
    fits = anchor + dc < lim
    width = torch.where(live, torch.where(fits, dc + 1, torch.ones_like(dc)), torch.zeros_like(dc))
    pos = torch.minimum(anchor[:, None] + torch.arange(W, device=anchor.device)[None, :], lim[:, None] - 1)
    pos = torch.where(live[:, None], pos, torch.arange(W, device=anchor.device)[None, :].expand_as(pos))
    return Prepared(lease, live, tokens[lease].long(), pos, width, anchor,
                    torch.where(live & fits, dc, torch.zeros_like(dc)), lim)


@dataclass
class Accepted:
    counts: torch.Tensor          # [n] 1..8 (0 where not live)
    token_ids: torch.Tensor       # [n, 8]: sampled[0..count-1], -1 after
    next_token: torch.Tensor      # [n] the bonus / correction token
    drafter_anchor: torch.Tensor  # [n] old anchor + count - 1
    redraft: torch.Tensor         # [n] live and (old anchor + count) + 7 < limit


def accept(tokens, meta, prep: Prepared, sampled, noise: int) -> Accepted:
    """Linear chain over sampled [n, 8] (the target's greedy token after each verify row); the live
    slots' rows of tokens / meta are advanced in place (current = next token, drafts the noise
    token, anchor and committed count + count, draft count 0)."""
    drafts = prep.tokens[:, 1:]
    j = torch.arange(K, device=sampled.device)[None, :]
    hit = (drafts == sampled[:, :K]) & (j < prep.drafts[:, None])
    matched = torch.cumprod(hit.long(), dim=1).sum(dim=1)
    count = torch.where(prep.live, matched + 1, torch.zeros_like(matched))
    o = torch.arange(W, device=sampled.device)[None, :]
    ids = torch.where(o < count[:, None], sampled, torch.full_like(sampled, -1))
    nxt = torch.gather(sampled, 1, matched[:, None])[:, 0]
    for i in torch.nonzero(prep.live).reshape(-1).tolist():
        s = int(prep.lease[i])
        tokens[s, 1:] = noise
        tokens[s, 0] = nxt[i]
        meta[s, ANCHOR] += count[i].to(meta.dtype)
        meta[s, COMMITTED] += count[i].to(meta.dtype)
        meta[s, DRAFTS] = 0
    redraft = prep.live & (prep.anchor + count + K < prep.limit)
    return Accepted(count, ids, nxt, prep.anchor + count - 1, redraft)


def commit(tokens, meta, lease, drafts, ok) -> None:
    """After the Markov chain: the drafts of the slots `ok` (whose new anchor + 7 < limit) become
    pending (draft_count 7), in place."""
    for i in torch.nonzero(ok).reshape(-1).tolist():
        s = int(lease[i])
        tokens[s, 1:] = drafts[i].to(tokens.dtype)
        meta[s, DRAFTS] = K
