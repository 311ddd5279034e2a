"""Run-config presets of the Flower tests."""

#: The built-in substrate at test size (2 layers, hidden 128, ~0.8 M parameters; tokenizer,
#: pre-training and knowledge fine-tune in about 25 s on a 2-core CPU instead of the default's
#: 12 minutes). Scenario tests add their own data sizes to it; ``substrate_cache`` (conftest)
#: builds each preset once per test session.
SMALL_SUBSTRATE = (
    "substrate.hidden-size=128 substrate.layers=2 substrate.intermediate-size=256 "
    "substrate.background-documents=200"
)

# The README's main job at test size: 20 authors, forget 10 % (2 authors over 5 forget clients),
# FIRM γ = 5 (the default γ = 8 is tuned for the default substrate and overshoots this one).
SMALL_TOFU = (
    f"{SMALL_SUBSTRATE} scenario.num-authors=20 scenario.forget-percent=10.0 "
    "scenario.retain-samples=100 eval.retain-samples=50 gamma=5.0"
)
