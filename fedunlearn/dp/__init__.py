"""Differential privacy for DP2Unlearning (docs/algorithms.md, "DP2Unlearning"): DP-SGD with a
persistent accountant (:mod:`fedunlearn.dp.dpsgd`) and DP-MLM text rewriting
(:mod:`fedunlearn.dp.mlm`)."""
