"""The engines that run a target: eyas' own static-cache forward (fastlm), the decoder's target runners (runners),
the embedded generation engines regeneration and greedy validation use (embedded, static, generate), token
sampling (sampling) and CUDA graphs of fixed-shape steps (graphs)."""
