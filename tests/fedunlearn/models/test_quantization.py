"""4-bit NF4 training copies: structure, and LoRA gradients that are right on this CPU."""

import copy

import torch
from peft import get_peft_model

from fedunlearn.models.quantization import bitsandbytes_available, quantize_4bit
from fedunlearn.qa_format import encode_qa
from fedunlearn.training.batching import collate, token_nll
from fedunlearn.training.lora import (
    LocalTrainSettings,
    LoraSettings,
    adapted_parameter_names,
    lora_config,
    train_lora_task_vector,
)


def test_bitsandbytes_is_installed_by_the_dev_extra():
    assert bitsandbytes_available()


def _batch(tokenizer, data, n=4):
    return collate(
        [encode_qa(tokenizer, r["question"], r["answer"]) for r in data.author_qa[:n]],
        tokenizer.pad_token_id,
    )


def _dequantized_copy(quantized, reference):
    """``reference`` with every adapted weight replaced by the NF4 weight, dequantised."""
    import bitsandbytes as bnb
    import bitsandbytes.functional as F

    plain = copy.deepcopy(reference)
    modules = dict(plain.named_modules())
    for name, module in quantized.named_modules():
        if isinstance(module, bnb.nn.Linear4bit):
            weight = F.dequantize_4bit(module.weight.data, module.weight.quant_state)
            modules[name].weight.data = weight.to(torch.float32).reshape(modules[name].weight.shape)
    return plain


def test_quantized_copy_has_nf4_layers_and_safe_cpu_kernels(tiny_model):
    import bitsandbytes as bnb

    quantized = quantize_4bit(tiny_model)
    layers = [m for m in quantized.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert len(layers) == 7 * tiny_model.config.num_hidden_layers  # lm_head stays dense
    assert all(m.support_avx512bf16_for_cpu is False for m in layers)
    assert all(m.weight.quant_state.quant_type == "nf4" for m in layers)


def test_lora_gradients_through_nf4_match_the_dequantised_weights(
    tiny_model, tiny_tokenizer, tiny_data
):
    """The NOTES pitfall: after an eval-mode no-grad forward (which repacks weights for the
    AVX512-BF16 CPU kernel unless disabled) the LoRA gradients must still be right."""
    quantized = quantize_4bit(tiny_model)
    plain = _dequantized_copy(quantized, tiny_model)
    batch = _batch(tiny_tokenizer, tiny_data)
    with torch.no_grad():  # the forward that used to switch kernels
        quantized.eval()
        q_logits = quantized(input_ids=batch["input_ids"]).logits
        p_logits = plain(input_ids=batch["input_ids"]).logits
    assert torch.allclose(q_logits, p_logits, atol=1e-3)
    lora = LoraSettings(rank=4, alpha=8.0)
    grads = []
    for model in (quantized, plain):
        torch.manual_seed(0)
        peft_model = get_peft_model(model, lora_config(lora))
        peft_model.train()
        for name, p in peft_model.named_parameters():  # B = 0 at init: give it a value
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.02, generator=torch.Generator().manual_seed(1))
        token_nll(peft_model, batch).mean().backward()
        grads.append(
            {
                n: p.grad.detach().clone()
                for n, p in peft_model.named_parameters()
                if p.requires_grad
            }
        )
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) == 2 * 7 * 2
    for name in grads[0]:
        assert torch.allclose(grads[0][name], grads[1][name], rtol=1e-3, atol=1e-6), name


def test_task_vector_from_a_4bit_model(tiny_model, tiny_tokenizer, tiny_data):
    lora = LoraSettings(rank=4, alpha=8.0)
    examples = [
        encode_qa(tiny_tokenizer, r["question"], r["answer"]) for r in tiny_data.author_qa[:8]
    ]
    task_vector, stats = train_lora_task_vector(
        quantize_4bit(tiny_model),
        examples,
        pad_token_id=tiny_tokenizer.pad_token_id,
        lora=lora,
        train=LocalTrainSettings(objective="ga", steps=3, lr=1e-3, batch_size=4),
    )
    assert sorted(task_vector) == sorted(adapted_parameter_names(tiny_model, lora))
    for name, delta in task_vector.items():
        assert delta.dtype == torch.float32 and torch.isfinite(delta).all(), name
        assert delta.abs().sum() > 0, name
    assert stats["loss_last"] < stats["loss_first"]  # GA: the (negated) loss goes down
