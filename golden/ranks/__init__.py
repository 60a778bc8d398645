"""golden.ranks: the 16-rank emulation (serving-contract.md §1.4; kernel-math.md K12, K17, K18, K28).

  layout        RankLayout / layout_for: ranks, TP groups, o_proj groups, vocab shards, experts per
                rank; the production EP16 layout and the reduced topologies of the small presets
  collectives   rank_bands (the CP split of a group's stream into rank-major bands), all_gather
  tp            o_proj_tp (2 of 8 groups per rank; "ordered" or "partial_sums" reduction), its fold
                of the ranks' contributions (hw.real's processes fold with it too), lm_head_tp (vocab/4
                shards, all-to-all back)
  ep            ep_moe: EP dispatch (source-rank-major packing), routed experts per rank, combine
  emulation     RankEmulation: the `par` object golden.dspark's compositions take
  target        the target forward (prefill and decode) split across the ranks
"""
from .emulation import RankEmulation
from .layout import RankLayout, layout_for

__all__ = ["RankEmulation", "RankLayout", "layout_for"]
