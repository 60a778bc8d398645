"""The lockstep reference pair: one DSpark serving step written twice, independently.

`golden_np` (NumPy, the golden side) and `torch_step` (torch, the device side) run the same
structure as the target and drafter programs on a small preset: paged raw KV per layer, CSA/HCA
compressor rings and compressed pools, single-KV-head attention with a sink over the sliding window
and the compressed rows, sqrt-softplus routing (hash-routed first layers), W8A8 SwiGLU experts,
LM head and greedy sampling, greedy K=7 verification, publication of committed rows into the
drafter's leased context pool, the three-layer drafter and the sequential Markov sampler.

It is the vehicle the lockstep machinery is proven on while golden's compositions
(`golden.compose`, `golden.dspark`) and the lowering land; `hw.golden_adapter` is the one place
that chooses which golden runs.  `spec` holds the shared geometry (pool layouts, sites in
dependency order, what each tensor is), `weights` the seeded synthetic checkpoint, `workload` the
scheduler that turns requests into dispatches.
"""
