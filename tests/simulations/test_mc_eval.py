"""The multiple-choice evaluation command's report: accuracy and letter counts agree."""

from fedunlearn.benchmarks.mmlu_files import load_mc_jsonl
from fedunlearn.models.llama import new_tiny_llama, tiny_llama_config
from simulations.mc_eval import letter_counts, score
from tests.letter_bias import always_answer
from tests.shared_paths import shared_data


def test_a_model_that_always_answers_b_scores_the_share_of_b(tiny_tokenizer):
    records = load_mc_jsonl(shared_data("wmdp-bio-200", "wmdp_bio_200.jsonl"))[:12]
    config = tiny_llama_config(
        len(tiny_tokenizer),
        hidden_size=64,
        num_hidden_layers=2,
        intermediate_size=128,
        max_position_embeddings=1024,
        eos_token_id=tiny_tokenizer.eos_token_id,
        pad_token_id=tiny_tokenizer.pad_token_id,
    )
    model = always_answer(new_tiny_llama(config, seed=0).eval(), tiny_tokenizer, "B")
    result = score(model, tiny_tokenizer, records, "biology")
    answers = letter_counts([r["answer"] for r in records])
    assert result["answers"] == answers and 0 < answers["B"] < 12
    assert result["predicted"] == {"A": 0, "B": 12, "C": 0, "D": 0}
    assert result["accuracy"] == answers["B"] / 12
