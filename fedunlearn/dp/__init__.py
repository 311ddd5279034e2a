"""Differential privacy for DP2Unlearning (SPEC §4): DP-SGD with a persistent accountant
(:mod:`fedunlearn.dp.dpsgd`) and DP-MLM text rewriting (:mod:`fedunlearn.dp.mlm`)."""
