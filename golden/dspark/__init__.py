"""golden.dspark: the DSpark drafter, the Markov sampler, acceptance and the fused K=7 step.

Modules (pure functions over arrays: state in, new state out, except `step.Run`, the one mutable
run record):
  state      the device state state_tokens [G, 64, 8] / state_meta [G, 64, 6] and its rules:
             seed, prepare (active width, clamped positions, fallback), accept (linear chain,
             1..8 tokens, drafter bridge), commit_drafts, release
  drafter    dspark_proj (K22), context KV into the lease ring (K23), the anchor-first 7-row query
             block with no causal mask and the three draft layers with their MoE (K24) -> head_hidden
  markov     markov_head (K25), dspark_markov: sequential sampling + the confidence logit (K26);
             confidence_probs: its sigmoid, the device program's output
  ring       drafter pools [3, 512, 32, 1, HD]; lease / filler ring slots (the lowering's formulas)
  summary    SpeculationCounters: upstream's speculation summary + acceptance per draft position
  step       Golden (config + weights), Run (mutable run state), prefill_and_seed (tail capture of
             the last 128 rows, seeding waves), fused_step (prepare -> target forward with eager
             publication -> accept -> drafter -> Markov -> commit), plain_step (K=0), generate, outputs
  variants   DEVICE (pypto-lib's kernels, the default) and V41 (the official V4.1-Flash drafter):
             hc order, q renormalization, confidence output, target-hidden tap, expert counts
             (docs/drafter.md)
  weights    DrafterCheckpoint: seeded synthetic drafter weights (the golden.checkpoint protocol)
  parallel   SINGLE: where a forward crosses ranks (row ownership, o_proj, MoE, vocab heads, the
             target forward); golden.ranks.RankEmulation is the 16-rank counterpart

The target-hidden capture (K21: the variant's tap, "hc_head_of_outputs" on the device,
"mean_of_inputs" in V4.1) is golden.compose.target_hidden over the target forward's taps.

    g = Golden(TINY, SyntheticCheckpoint(TINY), DrafterCheckpoint(TINY), nm="device", max_model_len=176)
    run = generate(g, [Prompt("r0", prompt, 40)], k=7)        # k=0: one row per request per step
    outputs(run)["r0"], run.counters.summary()
"""
