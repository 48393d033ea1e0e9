"""Models: loading them from disk (HF directories, GGUF and its converted cache), the lean
Llama forward pass with its few-row C kernels, reduced-vocabulary heads, the feature draft, and
the tiny random models the tests and the selftest build. Imports ``specdec.exact`` at most."""
