"""The training CLI: every flag documented, a tiny run that trains, saves, resumes and exports."""

import json

import pytest
import torch

from nanollm.cli.train import TRAIN_PRESETS, lr_at, main, make_batch, train
from nanollm.io import checkpoint


def test_help_documents_every_flag(capsys, monkeypatch):
    import argparse

    import pytest
    actions = []
    real_parse = argparse.ArgumentParser.parse_args
    monkeypatch.setattr(argparse.ArgumentParser, "parse_args",
                        lambda self, *a, **k: (actions.extend(self._actions), real_parse(self, *a, **k))[1])
    with pytest.raises(SystemExit):
        main(["--help"])
    text = capsys.readouterr().out
    assert actions and all(a.help for a in actions)
    for flag in ["--preset", "--out", "--resume", "--force", "--max-steps", "--lr", "--tokens-per-step", "--seed",
                 "--device", "--threads", "--init", "--export", "--quiet"]:
        assert flag in text


def test_lr_schedule():
    cfg = TRAIN_PRESETS["retrieval-llama"]
    assert lr_at(0, cfg) < lr_at(cfg.warmup - 1, cfg) == cfg.lr
    assert abs(lr_at(cfg.total_steps, cfg) - cfg.min_lr) < 1e-12


def test_batch_masks_answers_only():
    from nanollm.data.tasks import corpus
    from nanollm.io.tokenizer import Tokenizer
    tok = Tokenizer.train(corpus(50_000, seed=0), 512)
    ids, targets, answer = make_batch(tok, ["niah_single_noise"], 256, 3, seed=0)
    for i in range(3):
        ans = targets[i][answer[i]].tolist()
        assert ans[-1] == tok.eot_id and tok.decode(ans[:-1]).strip().isdigit()


@pytest.mark.slow
def test_tiny_run_trains_resumes_and_exports(tmp_path):
    cfg = TRAIN_PRESETS["tiny"]
    train(cfg, tmp_path / "run", max_steps=2, quiet=True)
    st = torch.load(tmp_path / "run" / "state.pt", weights_only=True)
    assert st["step"] == 2
    train(cfg, tmp_path / "run", resume=True, quiet=True)            # continues to the end of the curriculum
    st = torch.load(tmp_path / "run" / "state.pt", weights_only=True)
    assert st["step"] == cfg.total_steps
    log = [json.loads(line) for line in open(tmp_path / "run" / "log.jsonl")]
    assert [r["step"] for r in log] == list(range(1, cfg.total_steps + 1))
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in log)
    checkpoint.export_run(tmp_path / "run", tmp_path / "ckpt", card={"name": "tiny"})
    model, tok, card = checkpoint.load(tmp_path / "ckpt")
    assert card == {"name": "tiny"} and model.config.n_layer == 2
    ids = torch.tensor([tok.encode("The grass is green.")])
    assert torch.isfinite(model(ids)).all()
    # a new run can start from the exported checkpoint (weights and tokenizer)
    train(cfg, tmp_path / "run2", max_steps=0, quiet=True, init=str(tmp_path / "ckpt"))
    assert (tmp_path / "run2" / "tokenizer.json").read_text() == (tmp_path / "ckpt" / "tokenizer.json").read_text()
    st2 = torch.load(tmp_path / "run2" / "state.pt", weights_only=True)
    assert all(torch.equal(st2["model"][k], v) for k, v in model.state_dict().items())
