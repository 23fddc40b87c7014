"""User-level DP in the Hugging Face trainer: ``DPTrainer(..., privacy_unit="user",
user_id_column="user", examples_per_user=k | max_examples_per_user=K)``.

Tiny GPT-2 models built from a config, data made here (no download), CPU. At noise 0 with every
user sampled and k ≥ every user's row count, one step's update is the brute force
Σ_u clip(mean of u's per-row gradients, C) / U, the per-row gradients taken by separate backward
passes."""

from __future__ import annotations

import json
import logging
import math
import os
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
pytest.importorskip("accelerate")

import dpcore  # noqa: E402
from dpcore.accounting.samplers import sampler_epsilon  # noqa: E402
from dpcore.plan import calibrate_noise  # noqa: E402
from dpcore.transformers import DPTrainer, causal_lm_per_record_loss  # noqa: E402
from dpcore.transformers import _data as dp_data  # noqa: E402

torch.set_num_threads(1)

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*drawn from a test seed:dpcore.ledger.LedgerWarning"),
    pytest.mark.filterwarnings("ignore:DP trainer seed=:UserWarning"),
]

V, T = 100, 12  # vocabulary, sequence length
BOUNDS = ("examples_per_user", "max_examples_per_user")


def gpt2():
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=V, n_positions=32, resid_pdrop=0.0,
                                  embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=1, pad_token_id=1)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg)


def lora(model):
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], fan_in_fan_out=True, lora_dropout=0.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return peft.get_peft_model(model, cfg)


def rows(users, seed=0):
    """One row per entry of ``users`` (its user id): 4 to 12 tokens, right-padded to 12."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for u in users:
        length = int(torch.randint(4, T + 1, (1,), generator=g))
        ids = torch.randint(2, V, (T,), generator=g)
        mask = (torch.arange(T) < length).long()
        ids = ids.masked_fill(mask == 0, 1)
        out.append({"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100), "user": u})
    return out


# 6 users with 1 to 4 rows each (13 rows), interleaved in the dataset
SMALL_IDS = ["ann", "bob", "bob", "cat", "dan", "cat", "dan", "eve", "dan", "cat", "dan", "fay", "eve"]
SMALL = rows(SMALL_IDS)
# 40 users with 1 to 7 rows each, for the longer runs
LONG_IDS = [u for u in range(40) for _ in range(1 + u % 7)]


def targs(out, **kw):
    base = dict(output_dir=str(out), use_cpu=True, report_to=[], disable_tqdm=True, dataloader_num_workers=0,
                per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=3, logging_steps=1,
                save_strategy="no", learning_rate=1e-2, seed=0)
    base.update(kw)
    return transformers.TrainingArguments(**base)


class Recorded(list):
    """The bounds of the samples recorded, in order."""


@pytest.fixture
def recorded(monkeypatch):
    """The contribution bound of every sample recorded (a spy on PrivacyLedger.record_sample)."""
    seen = Recorded()
    real = dpcore.PrivacyLedger.record_sample

    def spy(self, *a, **kw):
        seen.append({k: kw[k] for k in BOUNDS if k in kw})
        return real(self, *a, **kw)

    monkeypatch.setattr(dpcore.PrivacyLedger, "record_sample", spy)
    return seen


@pytest.fixture
def fetched(monkeypatch):
    """The dataset rows of every micro-batch the trainer's loader fetches, with its tag."""
    parts = []
    real = dp_data.TrainerBatches._fetch

    def spy(self, idx):
        parts.append([int(i) for i in idx])
        return real(self, idx)

    monkeypatch.setattr(dp_data.TrainerBatches, "_fetch", spy)
    return parts


def users_of(parts, ids):
    return [[ids[i] for i in p] for p in parts]


# ----------------------------------------------------------------------------- (1) 20 steps


def test_lora_gpt2_twenty_steps_logs_user_level_epsilon(tmp_path, recorded, caplog):
    """A ``datasets.Dataset`` with a ``user`` column: users are sampled (k = 3), the column never
    reaches the model, the ledger's unit is "user" with U users, every sample carries k, and the
    ε logged every 5 steps is the ledger's user-level ε (the Poisson Gaussian over the users)."""
    datasets = pytest.importorskip("datasets")
    data = rows(LONG_IDS)
    ds = datasets.Dataset.from_list([{k: (v.tolist() if torch.is_tensor(v) else v) for k, v in r.items()} for r in data])
    assert "user" in ds.column_names
    model = lora(gpt2())
    before = {k: p.detach().clone() for k, p in model.named_parameters()}
    seen_keys = []
    real_loss = causal_lm_per_record_loss

    def loss(m, inputs):
        seen_keys.append(set(inputs))
        return real_loss(m, inputs)

    U, k, bs, ga = 40, 3, 4, 2
    with caplog.at_level(logging.INFO, logger="dpcore"):
        # remove_unused_columns=False: the Trainer keeps every column; the DP trainer drops the ids
        tr = DPTrainer(model=model, args=targs(tmp_path, max_steps=20, logging_steps=5, remove_unused_columns=False),
                       train_dataset=ds,
                       data_collator=transformers.default_data_collator, noise_multiplier=1.0, max_grad_norm=1.0,
                       per_record_loss=loss, privacy_unit="user", user_id_column="user", examples_per_user=k,
                       seed=3)
    assert any("user-level" in r.getMessage() for r in caplog.records)
    assert tr.privacy_unit == "user" and tr.user_index.num_users == U
    assert tr.sampling_probability == pytest.approx(bs * ga / U)
    assert tr.delta == pytest.approx(1 / (10 * U))  # δ well below 1/U: stated for users
    tr.train()
    assert seen_keys and all("user" not in s for s in seen_keys)  # the ids never reach the model
    for name, p in model.named_parameters():
        assert (not torch.equal(p, before[name])) == ("lora_" in name), name
    led = tr.ledger
    assert led.privacy_unit == "user" and led.num_releases == 20 and len(led.samples) == 20
    for s in led.samples:
        assert s.population_size == U and s.sampling_probability == pytest.approx(bs * ga / U) and len(s.queries) == 1
    assert len(recorded) == 20 and all(b == {"examples_per_user": k} for b in recorded)
    logs = [h for h in tr.state.log_history if "loss" in h]
    eps = [h["epsilon"] for h in logs]
    assert [h["step"] for h in logs] == [5, 10, 15, 20]
    assert all(b > a > 0 for a, b in zip(eps, eps[1:]))
    final = tr.get_epsilon()
    assert eps[-1] == final
    led.close()
    assert dpcore.PrivacyLedger.load(led.path).get_epsilon(tr.delta, accountant="pld") == pytest.approx(final, rel=1e-12)
    # users as records: the Poisson-subsampled Gaussian at q = 8/40 over 20 steps
    ref = sampler_epsilon("poisson", 1.0, 20, tr.delta, sampling_probability=bs * ga / U, accountant="pld")
    assert final == pytest.approx(ref, rel=1e-6)
    state = tr.state.log_history[-1]
    assert state["epsilon"] == final


# ----------------------------------------------------------------------------- (2) brute force


def brute_force_update(model, data, ids, clip, lr, den):
    """−lr · Σ_u clip(mean of u's per-row gradients, C) / den, each row's gradient by its own
    backward pass (flat clipping over the trainable parameters)."""
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    per_row = []
    for r in data:
        model.zero_grad()
        batch = transformers.default_data_collator([{k: v for k, v in r.items() if k != "user"}])
        causal_lm_per_record_loss(model, batch).sum().backward()
        per_row.append([p.grad.detach().double().clone() for _, p in params])
    total = [torch.zeros_like(g) for g in per_row[0]]
    norms = []
    for u in sorted(set(ids)):
        mine = [g for g, i in zip(per_row, ids) if i == u]
        mean = [sum(gs) / len(mine) for gs in zip(*mine)]
        norm = math.sqrt(sum(float((m * m).sum()) for m in mean))
        norms.append(norm)
        scale = min(1.0, clip / norm) if norm > 0 else 1.0
        total = [t + m * scale for t, m in zip(total, mean)]
    return {n: p.detach().double() - lr * t / den for (n, p), t in zip(params, total)}, norms


@pytest.mark.parametrize("bs, ga, kind", [(6, 1, "lora"), (3, 2, "lora"), (2, 3, "full")])
def test_one_step_at_noise_zero_is_the_per_user_clipped_mean(tmp_path, recorded, fetched, bs, ga, kind):
    """q = 1 (6 users, bs × ga = 6), k = 4 ≥ every user's count: every row of every user is in
    the step. Micro-batches (ga > 1) hold whole users; the update is the brute force."""
    U, lr = 6, 1.0
    C = {"lora": 0.12, "full": 3.0}[kind]
    make = (lambda: lora(gpt2())) if kind == "lora" else gpt2
    model, ref = make(), make()
    tr = DPTrainer(model=model, args=targs(tmp_path, per_device_train_batch_size=bs, gradient_accumulation_steps=ga,
                                           max_steps=1, optim="sgd", learning_rate=lr, lr_scheduler_type="constant",
                                           weight_decay=0.0, remove_unused_columns=False),
                   train_dataset=SMALL, data_collator=transformers.default_data_collator, noise_multiplier=0.0,
                   max_grad_norm=C, privacy_unit="user", user_id_column="user", examples_per_user=4, seed=7)
    assert tr.sampling_probability == 1.0 and tr.dp_optimizer is None
    groups = []
    real = dp_data.DPRun.set_groups

    def spy(self, tag):
        real(self, tag)
        groups.append(None if self.record_groups is None else self.record_groups.tolist())

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(dp_data.DPRun, "set_groups", spy)
        tr.train()
    assert tr.dp_optimizer.expected_batch_size == U
    # the step's micro-batches: whole users, user-major, every row of every user once
    assert len(fetched) == ga and len(groups) == ga
    per_part = users_of(fetched, SMALL_IDS)
    assert sorted(i for p in fetched for i in p) == list(range(len(SMALL)))
    users_seen = []
    for p, g in zip(per_part, groups):
        assert sum(g) == len(p)
        starts = np.concatenate([[0], np.cumsum(g)]).astype(int)
        for a, b in zip(starts[:-1], starts[1:]):
            assert len(set(p[a:b])) == 1  # one user per group
            users_seen.append(p[a])
    assert sorted(users_seen) == sorted(set(SMALL_IDS))  # no user split across micro-batches
    expect, norms = brute_force_update(ref, SMALL, SMALL_IDS, C, lr, U)
    assert min(norms) < C < max(norms), norms  # some users are clipped, some are not
    got = {n: p.detach().double() for n, p in model.named_parameters() if p.requires_grad}
    assert set(got) == set(expect)
    moved = 0.0
    for n in got:
        torch.testing.assert_close(got[n], expect[n], atol=2e-6, rtol=1e-4, msg=lambda m, n=n: f"{n}: {m}")
        moved = max(moved, float((got[n] - dict(ref.named_parameters())[n].detach().double()).abs().max()))
    assert moved > 1e-4  # the step did something
    assert list(recorded) == [{"examples_per_user": 4}]


def test_user_gradient_is_the_mean_not_the_sum(tmp_path, recorded):
    """With C large (no clipping) each of a user's rows weighs 1/count: a user whose one row is
    repeated three times moves the model as that row alone does (the mean of three equal
    gradients), not three times as far."""
    a, b = rows(["a", "b"])
    out = []
    for data in ([a, b], [a, a, a, b]):
        model = gpt2()
        tr = DPTrainer(model=model, args=targs(tmp_path / str(len(data)), per_device_train_batch_size=2,
                                               gradient_accumulation_steps=1, max_steps=1, optim="sgd",
                                               learning_rate=1.0, lr_scheduler_type="constant", weight_decay=0.0),
                       train_dataset=data, data_collator=transformers.default_data_collator, noise_multiplier=0.0,
                       max_grad_norm=1e6, privacy_unit="user", user_id_column="user", examples_per_user=3, seed=1)
        assert tr.sampling_probability == 1.0
        tr.train()
        out.append({n: p.detach().clone() for n, p in model.named_parameters()})
    for n in out[0]:
        torch.testing.assert_close(out[0][n], out[1][n], atol=1e-6, rtol=1e-5, msg=n)


# ----------------------------------------------------------------------------- (3) ELS


def test_example_level_sampling_bounds_each_user_to_K(tmp_path, recorded, fetched):
    K = 2
    data = rows(LONG_IDS)
    tr = DPTrainer(model=lora(gpt2()), args=targs(tmp_path, max_steps=4), train_dataset=data,
                   data_collator=transformers.default_data_collator, noise_multiplier=1.0, max_grad_norm=1.0,
                   privacy_unit="user", user_id_column="user", max_examples_per_user=K, seed=5)
    kept = tr.kept_examples
    ids = np.asarray(LONG_IDS)
    _, counts = np.unique(ids[kept], return_counts=True)
    _, full = np.unique(ids, return_counts=True)
    assert counts.max() <= K and np.array_equal(counts, np.minimum(full, K))  # every user keeps min(count, K)
    assert np.all(np.diff(kept) > 0)
    n_kept = int(np.minimum(full, K).sum())
    assert len(kept) == n_kept and tr.sampling_probability == pytest.approx(8 / n_kept)
    groups = []
    real = dp_data.DPRun.set_groups

    def spy(self, tag):
        real(self, tag)
        groups.append(self.record_groups)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(dp_data.DPRun, "set_groups", spy)
        tr.train()
    assert groups and all(g is None for g in groups)  # rows are clipped one by one
    drawn = [i for p in fetched for i in p]
    assert drawn and set(drawn) <= set(kept.tolist())
    led = tr.ledger
    assert led.privacy_unit == "user" and led.num_releases == 4
    assert all(s.population_size == n_kept for s in led.samples)
    assert list(recorded) == [{"max_examples_per_user": K}] * 4


def test_els_target_epsilon_calibrates_with_the_bound(tmp_path, recorded):
    K, eps, delta = 3, 4.0, 1e-5
    n_kept = int(np.minimum(np.unique(LONG_IDS, return_counts=True)[1], K).sum())
    q = 8 / n_kept
    z = calibrate_noise(eps, delta, sampler="poisson", sampling_probability=q, steps=5, accountant="pld",
                        max_examples_per_user=K)
    tr = DPTrainer(model=lora(gpt2()), args=targs(tmp_path, max_steps=5), train_dataset=rows(LONG_IDS),
                   data_collator=transformers.default_data_collator, target_epsilon=eps, target_delta=delta,
                   max_grad_norm=1.0, privacy_unit="user", user_id_column="user", max_examples_per_user=K)
    assert tr.noise_multiplier == z
    example_level = calibrate_noise(eps, delta, sampler="poisson", sampling_probability=q, steps=5, accountant="pld")
    assert z > example_level  # a user is up to K rows: more noise than for one row
    tr.train()
    assert tr.get_epsilon() <= eps


def test_uls_target_epsilon_calibrates_over_the_users(tmp_path, recorded):
    eps, delta, U = 3.0, 1e-4, 40
    tr = DPTrainer(model=lora(gpt2()), args=targs(tmp_path, max_steps=6), train_dataset=rows(LONG_IDS),
                   data_collator=transformers.default_data_collator, target_epsilon=eps, target_delta=delta,
                   max_grad_norm=1.0, privacy_unit="user", user_id_column="user", examples_per_user=2)
    z = calibrate_noise(eps, delta, sampler="poisson", sampling_probability=8 / U, steps=6, accountant="pld")
    assert tr.noise_multiplier == z
    tr.train()
    assert 0.99 * eps < tr.get_epsilon() <= eps


# ----------------------------------------------------------------------------- resume


def test_resume_with_other_user_ids_or_bound_is_refused(tmp_path, recorded):
    out = tmp_path / "run"

    def make(ids, k=2, max_steps=6):
        return DPTrainer(model=lora(gpt2()), args=targs(out, max_steps=max_steps, save_strategy="steps", save_steps=3),
                         train_dataset=[dict(r, user=u) for r, u in zip(rows(LONG_IDS), ids)],
                         data_collator=transformers.default_data_collator, noise_multiplier=1.0, max_grad_norm=1.0,
                         privacy_unit="user", user_id_column="user", examples_per_user=k, seed=2)

    first = make(LONG_IDS, max_steps=3)
    first.train()
    first.ledger.close()
    ckpt = out / "checkpoint-3"
    state = json.loads((ckpt / "dp_state.json").read_text())
    assert state["privacy_unit"] == "user" and state["users"] == first.user_index.fingerprint
    assert state["examples_per_user"] == 2 and state["num_users"] == 40
    moved = [u if u != 5 else 6 for u in LONG_IDS]  # user 5's rows now belong to user 6
    for ids, k, what in ((moved, 2, "other user ids"), (LONG_IDS, 3, "examples_per_user=2")):
        tr = make(ids, k)
        with pytest.raises(ValueError, match=what):
            tr.train(resume_from_checkpoint=str(ckpt))
        assert tr.ledger.num_releases == 3  # nothing recorded
        tr.ledger.close()
    # an example-level trainer cannot continue the user-level ledger, nor resume from its checkpoint
    with pytest.raises(ValueError, match="privacy unit"):
        DPTrainer(model=lora(gpt2()), args=targs(out, max_steps=6), train_dataset=rows(LONG_IDS),
                  data_collator=transformers.default_data_collator, noise_multiplier=1.0, max_grad_norm=1.0)
    tr = make(LONG_IDS)
    tr.train(resume_from_checkpoint=str(ckpt))  # the same ids: continues
    assert tr.ledger.num_releases == 6 and all(s.population_size == 40 for s in tr.ledger.samples)


def test_ids_changed_after_set_up_are_refused(tmp_path, recorded):
    data = rows(LONG_IDS)
    tr = DPTrainer(model=lora(gpt2()), args=targs(tmp_path), train_dataset=data,
                   data_collator=transformers.default_data_collator, noise_multiplier=1.0, max_grad_norm=1.0,
                   privacy_unit="user", user_id_column="user", examples_per_user=2)
    data[0]["user"] = 39
    with pytest.raises(ValueError, match="changed after the DP trainer was set up"):
        tr.train()
    assert tr.ledger.num_releases == 0 and len(recorded) == 0


# ----------------------------------------------------------------------------- (4) bad input


def _with(ids):
    return [dict(r, user=u) for r, u in zip(rows(["x"] * len(ids)), ids)]


GOOD = dict(privacy_unit="user", user_id_column="user", examples_per_user=2)


@pytest.mark.parametrize("data, kw, err", [
    (SMALL, dict(GOOD, user_id_column="author"), "row 0 of train_dataset has no such column"),
    ([{k: v for k, v in r.items() if k != "user"} if i == 5 else r for i, r in enumerate(SMALL)], GOOD,
     "row 5 of train_dataset has no such column"),
    (_with(["a", None, "b", "c"] * 3), GOOD, "must not be missing"),
    (_with([1.0, float("nan"), 2.0, 3.0] * 3), GOOD, "finite|missing"),
    (_with([1.5, 2.0, 3.0, 4.0] * 3), GOOD, "integers or strings"),
    (_with([1, "a", 2, 3] * 3), GOOD, "mixes integers and strings"),
    (SMALL, dict(GOOD, examples_per_user=0), ">= 1"),
    (SMALL, dict(GOOD, examples_per_user=-2), ">= 1"),
    (SMALL, dict(GOOD, examples_per_user=True), ">= 1"),
    (SMALL, dict(GOOD, examples_per_user=None, max_examples_per_user=0), ">= 1"),
    (SMALL, dict(GOOD, max_examples_per_user=2), "exactly one of"),
    (SMALL, dict(GOOD, examples_per_user=None), "exactly one of"),
    (SMALL, dict(privacy_unit="user", examples_per_user=2), "needs user_id_column"),
    (SMALL, dict(GOOD, user_id_column=3), "column name"),
    (SMALL, dict(examples_per_user=2), "need privacy_unit='user'"),
    (SMALL, dict(max_examples_per_user=2), "need privacy_unit='user'"),
    (SMALL, dict(user_id_column="user"), "need privacy_unit='user'"),
    (SMALL, dict(GOOD, privacy_unit="person"), "privacy_unit must be"),
    (SMALL, dict(GOOD, sampler="shuffle"), "Poisson"),
    (rows(list("abcde")), dict(GOOD, examples_per_user=None, max_examples_per_user=1), "exceeds the 5 rows"),
    (rows(["a", "b", "c"] * 2), GOOD, "exceeds the 3 users"),
])
def test_bad_input_fails_before_anything_is_recorded(tmp_path, recorded, data, kw, err):
    """Every bad input raises at construction, before the ledger is opened (bs × ga = 6: the
    6 users of SMALL could all be sampled, so only the error named is in the way)."""
    with pytest.raises((ValueError, TypeError), match=err):
        DPTrainer(model=lora(gpt2()), args=targs(tmp_path, per_device_train_batch_size=3), train_dataset=data,
                  data_collator=transformers.default_data_collator, noise_multiplier=1.0, max_grad_norm=1.0, **kw)
    assert not os.path.exists(tmp_path / "privacy_ledger.jsonl") and len(recorded) == 0


def test_bad_input_from_a_datasets_dataset(tmp_path, recorded):
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_list([{"input_ids": r["input_ids"].tolist(), "user": u} for r, u in zip(SMALL, SMALL_IDS)])
    with pytest.raises(ValueError, match=r"not a column of train_dataset \(its columns: \['input_ids', 'user'\]\)"):
        DPTrainer(model=lora(gpt2()), args=targs(tmp_path), train_dataset=ds, noise_multiplier=1.0, max_grad_norm=1.0,
                  **dict(GOOD, user_id_column="author"))
    bad = datasets.Dataset.from_list([{"input_ids": [1, 2], "user": u} for u in ["a", None, "b"] * 4])
    with pytest.raises(ValueError, match="column 'user' must not be missing: example 1"):
        DPTrainer(model=lora(gpt2()), args=targs(tmp_path), train_dataset=bad, noise_multiplier=1.0,
                  max_grad_norm=1.0, **GOOD)
    assert not os.path.exists(tmp_path / "privacy_ledger.jsonl") and len(recorded) == 0


def test_a_ledger_of_the_other_unit_is_refused(tmp_path, recorded):
    led = dpcore.PrivacyLedger(tmp_path / "example.jsonl")  # unit "example"
    with pytest.raises(ValueError, match="privacy unit 'example'"):
        DPTrainer(model=lora(gpt2()), args=targs(tmp_path, per_device_train_batch_size=3), train_dataset=SMALL,
                  data_collator=transformers.default_data_collator, noise_multiplier=1.0, max_grad_norm=1.0,
                  ledger=led, **GOOD)
    assert led.num_releases == 0 and len(recorded) == 0


# ----------------------------------------------------------------------------- grey-box


@pytest.mark.parametrize("kind", ["largest_user", "smallest_user"])
@pytest.mark.parametrize("ga", [1, 2])
def test_greybox_users_as_neighbours(tmp_path, recorded, kind, ga):
    """The grey-box harness with users as the neighbouring unit: the trainer on D and on D
    without its largest (or smallest) user runs the same control flow, ledger entries,
    denominator and noise, and the pre-noise sums differ by at most C. The user removed has the
    largest id and the last rows (users are numbered by sorted id, so it is removed at the end:
    the Poisson draws of the others stay the same); U is declared public (population_size)."""
    from dpcore.audit import neighbour_audit

    # the user to remove is the only one with most (fewest) rows
    counts = ([2, 1, 3, 1, 2, 1, 2, 1, 2, 1, 2] + [6]) if kind == "largest_user" else ([2, 3, 2, 2, 3, 2, 2, 4, 2, 3, 2] + [1])
    users = np.repeat(np.arange(12), counts)  # the user to remove is 11: largest id, last rows
    data0 = rows(users.tolist(), seed=4)
    toks = np.stack([r["input_ids"].numpy() for r in data0])
    mask = np.stack([r["attention_mask"].numpy() for r in data0])
    runs = iter(range(100))

    def train(cols, seed):
        t, m, u = cols
        data = [{"input_ids": torch.tensor(a), "attention_mask": torch.tensor(b),
                 "labels": torch.tensor(np.where(b == 1, a, -100)), "user": int(i)} for a, b, i in zip(t, m, u)]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            DPTrainer(model=lora(gpt2()), args=targs(tmp_path / f"r{next(runs)}", per_device_train_batch_size=4 // ga,
                                                     gradient_accumulation_steps=ga, max_steps=3),
                      train_dataset=data, data_collator=transformers.default_data_collator, noise_multiplier=1.0,
                      max_grad_norm=0.05, seed=seed, population_size=12, privacy_unit="user",
                      user_id_column="user", examples_per_user=3).train()

    res = neighbour_audit(train, (toks, mask, users), (kind,), user_column=2)
    res.raise_for_findings()
    assert all(r.releases == 3 for r in res.runs)
    assert max(r.max_ratio for r in res.runs) > 0.05  # the removed user did move the sum


def test_empty_and_small_user_samples_are_released(tmp_path, recorded, fetched):
    """q = 2/40 users: some steps sample no user (both micro-batches empty: pure noise is still
    released), some one user (one micro-batch empty). One sample and one release per step."""
    tr = DPTrainer(model=lora(gpt2()), args=targs(tmp_path, per_device_train_batch_size=1, max_steps=12),
                   train_dataset=rows(LONG_IDS), data_collator=transformers.default_data_collator,
                   noise_multiplier=1.0, max_grad_norm=1.0, privacy_unit="user", user_id_column="user",
                   examples_per_user=3, seed=2)  # seed 2: 0, 1, 2 ... 6 users in the 12 steps
    tr.train()
    steps = [fetched[i:i + 2] for i in range(0, len(fetched), 2)]
    assert len(steps) == 12
    users = [len({LONG_IDS[i] for p in s for i in p}) for s in steps]
    assert 0 in users and 1 in users  # an empty sample and a one-user sample
    assert all(len({LONG_IDS[i] for i in s[0]} & {LONG_IDS[i] for i in s[1]}) == 0 for s in steps)
    assert tr.ledger.num_releases == len(tr.ledger.samples) == 12


def test_make_private_trainer_takes_the_privacy_unit(tmp_path, recorded):
    trainer = transformers.Trainer(model=lora(gpt2()), args=targs(tmp_path, max_steps=2), train_dataset=rows(LONG_IDS),
                                   data_collator=transformers.default_data_collator)
    from dpcore.transformers import make_private_trainer

    make_private_trainer(trainer, noise_multiplier=1.0, max_grad_norm=1.0, privacy_unit="user",
                         user_id_column="user", examples_per_user=2, seed=0)
    assert trainer.privacy_unit == "user" and trainer.sampling_probability == pytest.approx(8 / 40)
    trainer.train()
    assert trainer.ledger.privacy_unit == "user" and trainer.ledger.num_releases == 2
    assert list(recorded) == [{"examples_per_user": 2}] * 2
