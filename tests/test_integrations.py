"""llmkernels inside the trainers fine-tuners use: Hugging Face ``Trainer`` and TRL's
``SFTTrainer`` train a tiny Llama patched before ``from_pretrained`` (``patch_model_type``) or
after it (``patch``) with the losses of the unpatched model, step by step. No hub downloads:
the model is saved from a config, the tokenizer built in memory."""
import pytest
import torch

transformers = pytest.importorskip("transformers")

import llmkernels as lk  # noqa: E402
from llmkernels import hf  # noqa: E402

from tests.conftest import DEVICE  # noqa: E402
from tests.helpers import rel_err  # noqa: E402

# One xdist worker runs this module: its reference runs and checkpoint are computed once.
pytestmark = pytest.mark.xdist_group("integrations")

VOCAB, SEQ, ROWS, STEPS = 256, 16, 6, 3
CONFIG = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, bos_token_id=1, eos_token_id=2, pad_token_id=0)


@pytest.fixture(autouse=True)
def _restore_transformers():
    yield
    hf.unpatch_all()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny random Llama saved as a checkpoint, with random norm weights (ones would hide a
    wrong scale)."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.randn_like(p) * 0.5 + 1.0)
    path = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(path)
    return path


def token_rows():
    g = torch.Generator().manual_seed(1)
    return torch.randint(3, VOCAB, (ROWS, SEQ), generator=g).tolist()


def trainer_args(cls, out, **extra):
    return cls(output_dir=str(out), max_steps=STEPS, per_device_train_batch_size=2, learning_rate=1e-2,
               lr_scheduler_type="constant", logging_steps=1, report_to="none", save_strategy="no", seed=0,
               data_seed=0, use_cpu=DEVICE == "cpu", disable_tqdm=True, dataloader_num_workers=0, **extra)


def run_trainer(model, out):
    rows = [{"input_ids": torch.tensor(r), "labels": torch.tensor(r)} for r in token_rows()]
    trainer = transformers.Trainer(model=model, args=trainer_args(transformers.TrainingArguments, out),
                                   train_dataset=rows)
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = {f"w{i}": i for i in range(VOCAB)}
    tok = Tokenizer(models.WordLevel(words, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="w0", bos_token="w1",
                                                eos_token="w2", unk_token="w0")


def run_sft_trainer(model, out, patch_after_load=False):
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    data = datasets.Dataset.from_dict({"input_ids": token_rows()})
    if patch_after_load:
        lk.patch(model)  # before the trainer: SFTTrainer wraps the model's forward with its fused LM head
    # fp32 as in the Trainer test (SFTConfig defaults to bf16 autocast); its default gradient
    # checkpointing stays on.
    args = trainer_args(trl.SFTConfig, out, max_length=SEQ, packing=False, bf16=False)
    trainer = trl.SFTTrainer(model=model, args=args,
                             train_dataset=data, processing_class=tokenizer())
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def load(path):
    return transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").to(DEVICE)


def assert_same_losses(losses, ref):
    assert len(losses) == len(ref) == STEPS, (losses, ref)
    assert max(abs(a - b) / abs(b) for a, b in zip(losses, ref)) < 1e-4, (losses, ref)
    assert ref[-1] < ref[0], ref  # the steps do train


@pytest.fixture(scope="module")
def reference_losses(checkpoint, tmp_path_factory):
    """Each trainer's losses for the unpatched model (computed before any patching: RoPE is
    patched module-level)."""
    out = tmp_path_factory.mktemp("reference")
    return {"Trainer": run_trainer(load(checkpoint), out / "trainer"),
            "SFTTrainer": run_sft_trainer(load(checkpoint), out / "sft")}


@pytest.mark.parametrize("when", ["patch_model_type before from_pretrained", "patch after from_pretrained"])
def test_trainer(when, checkpoint, reference_losses, tmp_path):
    if when.startswith("patch_model_type"):
        lk.patch_model_type("llama")
        model = load(checkpoint)
    else:
        model = load(checkpoint)
        report = lk.patch(model)
        assert "loss" not in report.not_patched, str(report)
    assert hf.is_patched(model.model.norm.forward) and hf.is_patched(model.model.layers[0].mlp.forward)
    assert_same_losses(run_trainer(model, tmp_path), reference_losses["Trainer"])


def test_sft_trainer(checkpoint, reference_losses, tmp_path):
    """Patched after from_pretrained and before the trainer is built (TRL wraps the forward)."""
    model = load(checkpoint)
    losses = run_sft_trainer(model, tmp_path, patch_after_load=True)
    assert hf.is_patched(model.model.norm.forward) and hf.is_patched(model.model.layers[0].mlp.forward)
    assert_same_losses(losses, reference_losses["SFTTrainer"])


def _logits_loss_and_grads(model):
    ids = torch.tensor(token_rows()[:2], device=DEVICE)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    return out.logits.detach(), out.loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def test_kernelize_picks_llmkernels_rmsnorm(checkpoint):
    """llmkernels.hf_kernels.kernelize marks LlamaRMSNorm where transformers did not (it marks
    only with a kernels version it accepts), then kernels.kernelize binds llmkernels' layer."""
    kernels = pytest.importorskip("kernels")
    from transformers.utils.import_utils import is_kernels_available

    from llmkernels.hf_kernels import RMSNorm, kernelize, mark_layers

    cls = transformers.models.llama.modeling_llama.LlamaRMSNorm
    ref, model = load(checkpoint).train(), load(checkpoint).train()
    marked = mark_layers(model)
    try:
        assert marked == ([] if is_kernels_available() else [cls]) and cls.kernel_layer_name == "RMSNorm"
        assert kernelize(model, mode=kernels.Mode.TRAINING, device=DEVICE) is model
        norms = [m for m in model.modules() if type(m) is cls]
        assert len(norms) == 3 and all(m.forward.__func__ is RMSNorm.forward for m in norms)
        (logits, loss, grads), (ref_logits, ref_loss, ref_grads) = map(_logits_loss_and_grads, (model, ref))
    finally:
        for c, attr in [(c, a) for c in marked for a in ("kernel_layer_name", "kernel_condition") if a in vars(c)]:
            delattr(c, attr)  # as transformers left it
    assert rel_err(logits, ref_logits) < 1e-5 and rel_err(loss, ref_loss) < 1e-5
    for name, g in grads.items():
        assert rel_err(g, ref_grads[name]) < 1e-4, name


def test_from_pretrained_use_kernels_picks_llmkernels_rmsnorm(checkpoint):
    """transformers' own path; it needs a ``kernels`` version this transformers accepts."""
    kernels = pytest.importorskip("kernels")
    from transformers.utils.import_utils import is_kernels_available

    if not is_kernels_available():
        pytest.skip(f"transformers {transformers.__version__} does not accept kernels {kernels.__version__}")
    from llmkernels.hf_kernels import RMSNorm, kernel_mapping

    with kernels.use_kernel_mapping(kernel_mapping()):
        model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, use_kernels=True).to(DEVICE)
    assert model.model.norm.forward.__func__ is RMSNorm.forward
