"""The algorithm, as in the papers (Leviathan et al. 2023, Chen et al. 2023), and nothing else:
counter-based randomness, the logits-to-distribution transforms both sides share, sparse draft
distributions, proposals, and the verifier (accept / recovered / bonus). No I/O, no models, no
gRPC. The lowest layer: it imports only ``specdec.errors``."""
