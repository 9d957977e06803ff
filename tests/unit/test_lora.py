"""LoRA adapters (verl_async/lora.py): what the learner sends, and what a generator
rebuilds from it, against peft's own saved format and logits."""

import copy

import pytest
import torch

from learners.logprobs import logits_of, token_stats
from verl_async import lora
from verl_async.schema import LoraConfig

VOCAB = 61


def _base():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    return LlamaForCausalLM(config).to(torch.float32)


def _trained(cfg: LoraConfig, seed: int = 1):
    """A peft model whose adapter is not zero (as after some training)."""
    model = lora.apply(_base(), cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if lora.is_adapter(name):
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return model


def _ids():
    g = torch.Generator().manual_seed(3)
    return torch.randint(0, VOCAB, (3, 9), generator=g)


def test_only_the_adapter_trains_and_its_names_are_peft_s_saved_ones():
    from peft import get_peft_model_state_dict

    cfg = LoraConfig(rank=4, alpha=8.0)
    model = _trained(cfg)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(lora.is_adapter(n) for n in trainable)
    sent = lora.adapter_state(model.state_dict())
    saved = get_peft_model_state_dict(model)
    assert set(sent) == set(saved)
    for name, t in sent.items():
        torch.testing.assert_close(t, saved[name])
        assert lora.saved_name(lora.model_name(name)) == name
    # q, k, v and o projections of 2 layers, A and B each
    assert len(sent) == 2 * 4 * 2


def test_a_generator_copy_takes_the_adapter_in_place_and_matches_the_logits():
    cfg = LoraConfig(rank=4, alpha=8.0)
    learner = _trained(cfg)
    generator = lora.apply(_base(), cfg)  # the same base, adapter at its start
    ids = _ids()
    attn = torch.ones_like(ids)
    before = generator(input_ids=ids).logits
    base_logits = _base()(input_ids=ids).logits
    torch.testing.assert_close(before, base_logits)  # lora_B = 0: the base model
    lora.load_adapter(generator, lora.adapter_state(learner.state_dict()))
    torch.testing.assert_close(generator(input_ids=ids).logits, learner(input_ids=ids).logits)
    assert not torch.allclose(generator(input_ids=ids).logits, base_logits)
    # The learner's response-only log-probs see through peft too.
    mask = torch.zeros(3, 8)
    mask[:, 4:] = 1
    stats = token_stats(learner, ids, attn, mask, entropy=True)
    full = torch.log_softmax(logits_of(learner, ids, attn), -1)[:, :-1]
    ref = full.gather(-1, ids[:, 1:, None]).squeeze(-1)
    torch.testing.assert_close(stats.logp[:, 4:], ref[:, 4:], atol=1e-5, rtol=1e-5)


def test_a_partial_or_foreign_adapter_is_refused():
    cfg = LoraConfig(rank=4)
    model = _trained(cfg)
    sent = lora.adapter_state(model.state_dict())
    partial = dict(list(sent.items())[1:])
    with pytest.raises(ValueError, match="missing"):
        lora.load_adapter(copy.deepcopy(model), partial)
    foreign = {
        **sent,
        "base_model.model.model.layers.9.mlp.up_proj.lora_A.weight": torch.zeros(4, 32),
    }
    with pytest.raises(ValueError, match="unknown"):
        lora.load_adapter(copy.deepcopy(model), foreign)


def test_an_unknown_target_module_names_the_key():
    with pytest.raises(ValueError, match="model.lora.target_modules"):
        lora.apply(_base(), LoraConfig(rank=4, target_modules=["no_such_proj"]))


def test_the_adapter_directory_loads_in_peft_with_the_same_logits(tmp_path):
    from peft import PeftModel

    cfg = LoraConfig(rank=8, alpha=16.0, target_modules=["all-linear"])
    model = _trained(cfg)
    base_dir = tmp_path / "base"
    _base().save_pretrained(base_dir)
    out = lora.write_adapter_dir(
        tmp_path / "adapter", lora.adapter_state(model.state_dict()), cfg, str(base_dir)
    )
    loaded = PeftModel.from_pretrained(_base(), out)
    ids = _ids()
    torch.testing.assert_close(loaded(input_ids=ids).logits, model(input_ids=ids).logits)


@pytest.mark.parametrize("tie", [True, False])
def test_a_weight_update_leaves_out_the_tied_head(tie):
    """A tied output head is the embedding under a second name: sent once."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from verl_async.weight_sync import without_tied

    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tie,
    )  # fmt: skip
    model = LlamaForCausalLM(config)
    state = model.state_dict()
    sent = without_tied(model, state)
    assert set(state) - set(sent) == ({"lm_head.weight"} if tie else set())
    peft_model = lora.apply(model, LoraConfig(rank=4))
    dropped = set(peft_model.state_dict()) - set(without_tied(peft_model, peft_model.state_dict()))
    assert dropped == ({"base_model.model.lm_head.weight"} if tie else set())


def _adapter(cfg: LoraConfig) -> dict[str, torch.Tensor]:
    return lora.adapter_state(_trained(cfg).state_dict())


def test_a_generators_adapters_are_written_where_only_its_user_may_enter(tmp_path):
    """Whatever the umask (0 here: everything world-writable), the engine's adapter
    directory is 0700, so no other user can read an adapter or swap its files before
    vLLM loads them."""
    import os
    import stat

    from generators.vllm_extension import _write_atomically

    cfg = LoraConfig(rank=4, target_modules=["all-linear"])
    base_dir = tmp_path / "base"
    _base().save_pretrained(base_dir)
    old = os.umask(0)
    try:
        _write_atomically(tmp_path / "shm" / "engine" / "v1", _adapter(cfg), cfg, str(base_dir))
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "shm" / "engine").stat().st_mode) == 0o700
    assert (tmp_path / "shm" / "engine" / "v1" / "adapter_model.safetensors").is_file()


def test_an_adapter_directory_someone_else_could_enter_is_refused(tmp_path):
    """A name made first by somebody else (here: left open to everyone) is not written."""
    import os

    from generators.vllm_extension import _write_atomically

    cfg = LoraConfig(rank=4, target_modules=["all-linear"])
    planted = tmp_path / "shm" / "engine"
    planted.mkdir(parents=True)
    os.chmod(planted, 0o777)
    with pytest.raises(PermissionError, match="not a private directory"):
        _write_atomically(planted / "v1", _adapter(cfg), cfg, str(tmp_path))
    assert list(planted.iterdir()) == []
