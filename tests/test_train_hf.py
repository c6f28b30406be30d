"""``pyparallel train --model HF_FOLDER`` fine-tunes a Hugging Face folder's weights: the folder's tokenizer
encodes the text, each rank streams its slices of the safetensors (the model is built on meta), and the
losses and the exported folder equal the same AdamW steps on ``from_pretrained`` in one process -- under
TP (an odd vocabulary, padded), ZeRO-3 and PP; a resumed run continues from its checkpoint without the
folder; a folder with only pickled weights is refused before any process starts; and a config.json alone
(random init, LLaMA and GPT-2's tied head) trains as the same seeded model in one process in every layout."""

import json
import os

import pytest
import torch
import torch.nn.functional as F
from dist import run
from models import hf_config, train_built_on_meta

from pyparallel import data
from pyparallel import train as train_mod

VOCAB = 301  # odd: TP pads the vocabulary matrix; the tokenizer uses fewer ids than the config allows
STEPS = ["--steps", "3", "--batch", "4", "--seq", "16", "--lr", "3e-3", "--no-progress"]


def make_folder(root) -> str:
    """A tiny LLaMA checkpoint folder as ``save_pretrained`` writes it, with a BPE tokenizer trained on
    the shipped corpus (no download)."""
    import tokenizers
    import transformers
    from tokenizers import models, pre_tokenizers, trainers

    folder = os.path.join(root, "hf")
    tok = tokenizers.Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator([data.load_text()], trainers.BpeTrainer(vocab_size=280, special_tokens=["<unk>"],
                                                                    initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")
    torch.manual_seed(7)
    model = transformers.LlamaForCausalLM(hf_config("llama", vocab=VOCAB, hidden=32, heads=4, kv_heads=2))
    model.save_pretrained(folder, safe_serialization=True)
    fast.save_pretrained(folder)
    return folder


def train_like_train(model, args, steps: int) -> list[float]:
    """The AdamW steps ``train`` takes (clip 1.0, weight decay 0.1), on the same batches, in one process."""
    tokens, _, _ = train_mod.encode_text(args)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    losses = []
    for step in range(steps):
        idx, tgt = data.batch(tokens, step, args.batch, args.seq, seed=args.seed)
        loss = F.cross_entropy(model(idx).logits.flatten(0, 1), tgt.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def reference(folder, steps: int):
    """One process: from_pretrained, the same batches and AdamW (clip 1.0, weight decay 0.1) as train."""
    import transformers

    args = train_mod.build_parser().parse_args([*STEPS, "--model", folder])
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    losses = train_like_train(model, args, steps)
    return losses, {n: p.detach().clone() for n, p in model.state_dict().items()}


def fine_tune_body(folder, root, layout):
    args = train_mod.build_parser().parse_args([*STEPS, "--model", folder, *layout, "--checkpoint-dir",
                                                os.path.join(root, "ckpt"), "--export", os.path.join(root, "out")])
    return train_built_on_meta(args)["losses"]  # the whole model is only ever built on the meta device


LAYOUTS = {"tp2": ["--tp", "2"], "zero3-dp2": ["--dp", "2", "--zero", "3"],
           "pp2": ["--pp", "2", "--micro-batches", "2"]}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_folder(str(tmp_path_factory.mktemp("hf")))


@pytest.fixture(scope="module")
def expected(folder):
    return reference(folder, 3)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_fine_tune_equals_one_process_and_exports(tmp_path, folder, expected, layout):
    import transformers

    losses = run(fine_tune_body, 2, folder, str(tmp_path), LAYOUTS[layout])[0]
    ref_losses, ref_state = expected
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    out = tmp_path / "out"
    tuned = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    for name, value in tuned.state_dict().items():
        torch.testing.assert_close(value, ref_state[name], rtol=1e-4, atol=1e-5, msg=name)
    # The tokenizer travels with the export, so the folder is usable as it is.
    tok = transformers.AutoTokenizer.from_pretrained(str(out), local_files_only=True)
    original = transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)
    assert tok("hello world")["input_ids"] == original("hello world")["input_ids"]


def resume_body(folder, root):
    ckpt = os.path.join(root, "ckpt")
    first = train_mod.train(train_mod.build_parser().parse_args(
        [*STEPS, "--model", folder, "--tp", "2", "--steps", "2", "--checkpoint-dir", ckpt]))
    resumed = train_mod.train(train_mod.build_parser().parse_args(
        [*STEPS, "--model", folder, "--tp", "2", "--checkpoint-dir", ckpt, "--resume"]))
    return first["losses"], resumed["start"], resumed["losses"]


def test_resume_continues_from_the_checkpoint_not_the_folder(tmp_path, folder, expected):
    first, start, resumed = run(resume_body, 2, folder, str(tmp_path))[0]
    assert start == 2
    torch.testing.assert_close(torch.tensor(first + resumed), torch.tensor(expected[0]), rtol=1e-5, atol=1e-6)


def test_pickled_weights_and_mismatched_folders_are_refused_before_spawning(tmp_path, folder, capsys):
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "config.json").write_text((open(os.path.join(folder, "config.json"))).read())
    (pickled / "pytorch_model.bin").write_bytes(b"")
    assert train_mod.main([*STEPS, "--model", str(pickled)]) == 2
    assert "holds pytorch_model.bin but no model.safetensors" in capsys.readouterr().err

    # A config that does not match the weights: named tensors, before any process exists.
    other = tmp_path / "other"
    other.mkdir()
    cfg = json.load(open(os.path.join(folder, "config.json")))
    cfg["intermediate_size"] = cfg["intermediate_size"] * 2
    (other / "config.json").write_text(json.dumps(cfg))
    os.symlink(os.path.join(folder, "model.safetensors"), other / "model.safetensors")
    assert train_mod.main([*STEPS, "--model", str(other)]) == 2
    err = capsys.readouterr().err
    assert "with the wrong shape" in err and "mlp.gate_proj.weight" in err

    # The tokenizer's ids must fit the config's vocabulary.
    small = tmp_path / "small"
    small.mkdir()
    cfg = json.load(open(os.path.join(folder, "config.json")))
    cfg["vocab_size"] = 200
    (small / "config.json").write_text(json.dumps(cfg))
    for f in os.listdir(folder):
        if f.startswith("tokenizer") or f == "special_tokens_map.json":
            os.symlink(os.path.join(folder, f), small / f)
    assert train_mod.main([*STEPS, "--model", str(small)]) == 2
    assert "vocab_size 200 is smaller than the text's tokens need" in capsys.readouterr().err


# ------------------------------------------------------------------ a config.json alone: random init
# No weights: every rank initialises one full-size module at a time under the seed of its name (what
# from_config does, reset_parameters then _init_weights) and keeps its slices, so the model -- and the
# losses -- must not depend on the layout. GPT-2 ties its LM head to the embedding (across the stages under
# PP); both vocabularies are odd, so TP pads them.
CONFIGS = {"llama": dict(vocab=301), "gpt2": dict(vocab=259)}


def write_config(root, kind: str) -> str:
    path = os.path.join(root, f"{kind}.json")
    hf_config(kind, hidden=32, heads=4, kv_heads=2, **CONFIGS[kind]).to_json_file(path)
    return path


def config_reference(path: str, steps: int):
    """One process: the whole model built on meta, initialised by the same seeded default init, the same
    batches and AdamW as train."""
    import transformers

    from pyparallel import materialize

    args = train_mod.build_parser().parse_args([*STEPS, "--model", path])
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(path)).float()
    materialize.initialize(model, torch.device("cpu"), init=materialize.seeded_default(model, args.seed))
    return train_like_train(model, args, steps)


def config_body(path, layout):
    args = train_mod.build_parser().parse_args([*STEPS, "--model", path, *layout])
    return train_built_on_meta(args)["losses"]


@pytest.mark.parametrize("kind", list(CONFIGS))
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_config_alone_trains_as_one_process_in_every_layout(tmp_path, kind, layout):
    path = write_config(str(tmp_path), kind)
    want = config_reference(path, 3)
    losses = run(config_body, 2, path, LAYOUTS[layout])[0]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want), rtol=1e-5, atol=1e-6)
