"""golden.dspark: the DSpark drafter, the Markov sampler, acceptance and the fused K=7 step.

Modules (each a set of pure functions over arrays; state in, new state out):
  state      device state state_tokens [G, 64, 8] / state_meta [G, 64, 6]; prepare, accept
             (linear chain, 1..8 tokens), commit_drafts, seed, release
  drafter    dspark_proj (K22), context KV into the lease ring (K23), the anchor-first 7-row query
             block with no causal mask and the three draft layers (K24) -> head_hidden
  markov     markov_head (K25), dspark_markov: sequential sampling + confidence (K26)
  ring       the drafter pools [3, 512, 32, 1, HD] and the lease / filler rings that address them
  summary    SpeculationCounters: upstream's speculation summary + acceptance per draft position
  step       Golden (config + weights), Run (mutable run state), prefill_and_seed (tail capture,
             seeding waves), fused_step, plain_step (K=0), generate, outputs
  weights    DrafterCheckpoint: seeded synthetic drafter weights (checkpoint protocol)
  parallel   SINGLE: where a forward crosses ranks (o_proj, MoE, vocab heads, row ownership);
             golden.ranks.RankEmulation is the 16-rank counterpart

The target hidden capture (K21, `target_hidden_tap` = "hc_head_of_outputs" | "mean_of_inputs") is
golden.compose.target_hidden over the target forward's taps.
"""
