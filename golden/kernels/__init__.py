"""Golden kernels, one module per kernel family (kernel-math.md §4).

Every kernel is a function: arrays and state in, arrays and new state out, with the ABI's argument
names and a `Numerics` object (mode + array namespace) as the keyword `nm`.  Activations come back
in the compute dtype already rounded where the device contract rounds; pools keep their storage
dtype (bf16 / int8 / f32 in device mode, float64 in exact mode).
"""
