"""Chat data end to end: ``dataio shard`` of conversations (messages, ShareGPT, prompt/completion; JSONL and Parquet)
with a tokenizer directory's chat template, the stored ids and trained-token mask against transformers'
``apply_chat_template``, the packed rows' labels, the long-conversation rule, and bad input through the CLI."""

from __future__ import annotations

import json
import tarfile

import numpy as np
import pytest

from headrace.dataio import build_loader
from headrace.dataio.cli import main as dataio_main
from headrace.dataio.config import DataConfig
from headrace.dataio.prepare.chat_template import load_chat_template
from headrace.config import from_dict
from headrace.kernels.loss import IGNORE_INDEX
from headrace.dataio.bench.chat_corpus import (
    TEMPLATE_PLAIN,
    TEMPLATE_STRICT,
    conversations,
    make_tokenizer_dir,
    write_jsonl,
)


@pytest.fixture(scope="module")
def tokdir(tmp_path_factory):
    return make_tokenizer_dir(tmp_path_factory.mktemp("tok") / "marked")


def _cli(capsys, *argv) -> tuple[int, str]:
    code = dataio_main([str(a) for a in argv])
    return code, capsys.readouterr().err


def _hf(tokdir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tokdir))


def _members(root) -> dict[str, dict[str, bytes]]:
    out: dict[str, dict[str, bytes]] = {}
    for tar in sorted(root.glob("*.tar")):
        with tarfile.open(tar) as t:
            for m in t.getmembers():
                key, _, ext = m.name.partition(".")
                out.setdefault(key, {})[ext] = t.extractfile(m).read()
    return out


def _npy(payload: bytes) -> np.ndarray:
    import io

    return np.load(io.BytesIO(payload), allow_pickle=False)


def test_mask_equals_transformers_with_and_without_generation_markers(tmp_path, tokdir):
    """The template with {% generation %} gives transformers' assistant mask; the same template without markers
    gives the same mask through the turn-by-turn rule (and transformers' ids either way)."""
    from tokenizers import Tokenizer

    from headrace.dataio.prepare.chat_template import encode_conversations

    hf = _hf(tokdir)
    plain = make_tokenizer_dir(tmp_path / "plain", TEMPLATE_PLAIN)
    tok = Tokenizer.from_file(str(tokdir / "tokenizer.json"))
    convs = conversations(40, seed=1)
    expected = [
        hf.apply_chat_template(c, tokenize=True, return_dict=True, return_assistant_tokens_mask=True) for c in convs
    ]
    for d in (tokdir, plain):
        template = load_chat_template(str(d))
        assert template.has_generation_markers == (d == tokdir)
        rendered = [template.render(c) for c in convs]
        encoded = encode_conversations(
            tok, [r[0] for r in rendered], [r[1] for r in rendered], np.dtype("<u2"), 1 << 20
        )
        for (ids, mask), want in zip(encoded, expected):
            assert ids.tolist() == list(want["input_ids"])
            assert mask.tolist() == list(want["assistant_masks"])
            assert 0 < mask.sum() < len(mask)


def _records(convs, form: str) -> list[dict]:
    if form == "messages":
        return [{"messages": c} for c in convs]
    if form == "conversations":
        names = {"system": "system", "user": "human", "assistant": "gpt"}
        return [{"conversations": [{"from": names[m["role"]], "value": m["content"]} for m in c]} for c in convs]
    return [{"prompt": c[-2]["content"], "completion": c[-1]["content"]} for c in convs]  # prompt/completion


def _expected(hf, conv, form):
    if form == "prompt":
        conv = conv[-2:]
    return hf.apply_chat_template(conv, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)


@pytest.mark.parametrize("form", ["messages", "conversations", "prompt"])
@pytest.mark.parametrize("suffix", ["jsonl", "parquet"])
def test_shard_stores_ids_and_mask(tmp_path, tokdir, capsys, form, suffix):
    convs = conversations(30, seed=2)
    records = _records(convs, form)
    src = tmp_path / f"chat.{suffix}"
    if suffix == "jsonl":
        write_jsonl(src, records)
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(records), src, row_group_size=7)
    out = tmp_path / "shards"
    code, err = _cli(
        capsys,
        "shard",
        src,
        "--output",
        out,
        "--tokenizer",
        tokdir,
        "--samples-per-shard",
        8,
        "--workers",
        2,
        "--quiet",
    )
    assert code == 0, err
    hf = _hf(tokdir)
    members = _members(out)
    assert len(members) == len(convs)
    for i, conv in enumerate(convs):
        sample = members[f"chat-{i + 1:09d}"]
        assert set(sample) == {"json", "npy", "trained.npy"}
        want = _expected(hf, conv, form)
        assert _npy(sample["npy"]).tolist() == list(want["input_ids"])
        assert _npy(sample["trained.npy"]).tolist() == list(want["assistant_masks"])
        assert json.loads(sample["json"])["line"] == i + 1
    assert _cli(capsys, "verify", out, "--quiet")[0] == 0  # every member decodes, the index agrees
    # webdataset reads the shards as they are
    import webdataset as wds

    seen = list(wds.WebDataset([str(p) for p in sorted(out.glob("*.tar"))], shardshuffle=False).decode())
    assert len(seen) == len(convs) and all(s["trained.npy"].dtype == np.uint8 for s in seen)


def _loader(root, **data):
    cfg = {"datasets": [{"path": str(root)}], "shuffle": False, "num_workers": 0, "epochs": 1, **data}
    return build_loader(from_dict(DataConfig, cfg), dp_rank=0, dp_size=1)


def test_packed_rows_label_only_the_assistants_tokens(tmp_path, tokdir, capsys):
    convs = conversations(60, seed=3, max_turns=4)
    write_jsonl(tmp_path / "c.jsonl", [{"messages": c, "id": f"c{i}"} for i, c in enumerate(convs)])
    out = tmp_path / "shards"
    assert _cli(capsys, "shard", tmp_path / "c.jsonl", "--output", out, "--tokenizer", tokdir, "--quiet")[0] == 0
    hf = _hf(tokdir)
    want = {f"c{i}": _expected(hf, c, "messages") for i, c in enumerate(convs)}
    longest = max(len(w["input_ids"]) for w in want.values())
    seen = set()
    for batch in _loader(out, packing="best_fit", seq_len=longest + 17, batch_size=2):
        ids, labels = batch["input_ids"].view(-1), batch["labels"].view(-1)
        seq_len = batch["input_ids"].shape[1]
        for r, row in enumerate(batch["__docs__"]):
            start = r * seq_len
            for ref, offset, length in row:
                key = f"c{ref}"
                w = want[key]
                assert offset == 0 and length == len(w["input_ids"])  # whole conversations
                assert ids[start : start + length].tolist() == list(w["input_ids"])
                mask = np.asarray(w["assistant_masks"])
                expected = np.where(mask[1:] == 1, np.asarray(w["input_ids"][1:]), IGNORE_INDEX).tolist()
                assert labels[start : start + length].tolist() == expected + [IGNORE_INDEX]
                start += length
                seen.add(key)
        assert batch["skipped_conversations"] == 0
    assert seen == set(want)


@pytest.mark.parametrize("policy", ["skip", "truncate", "error"])
def test_long_conversations_policy(tmp_path, tokdir, capsys, policy):
    from headrace.dataio.usererror import SampleDecodeError

    short, long = conversations(6, seed=4), conversations(2, seed=5, max_turns=8, words=(20, 30))
    convs = short[:3] + long[:1] + short[3:] + long[1:]
    write_jsonl(tmp_path / "c.jsonl", [{"messages": c, "id": f"c{i}"} for i, c in enumerate(convs)])
    out = tmp_path / "shards"
    assert _cli(capsys, "shard", tmp_path / "c.jsonl", "--output", out, "--tokenizer", tokdir, "--quiet")[0] == 0
    hf = _hf(tokdir)
    lengths = [len(_expected(hf, c, "messages")["input_ids"]) for c in convs]
    seq_len = max(lengths[i] for i in (0, 1, 2, 4, 5, 6)) + 1
    assert lengths[3] > seq_len and lengths[7] > seq_len
    loader = _loader(out, packing="greedy", seq_len=seq_len, batch_size=1, long_conversations=policy)
    if policy == "error":
        with pytest.raises(SampleDecodeError, match=r"key 'c3'.*longer than seq_len"):
            list(loader)
        return
    batches = list(loader)
    pieces = [d for b in batches for row in b["__docs__"] for d in row]
    refs = sorted(p[0] for p in pieces)
    if policy == "skip":
        assert refs == [0, 1, 2, 4, 5, 6] and batches[-1]["skipped_conversations"] == 2
    else:
        assert refs == list(range(8)) and all(p[2] <= seq_len for p in pieces)
        assert [p for p in pieces if p[0] == 3] == [(3, 0, seq_len)]


def _bad(tmp_path, name, line):
    path = tmp_path / f"{name}.jsonl"
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "the mill"}]}
    path.write_text(json.dumps(good) + "\n" + line + "\n" + json.dumps(good) + "\n")
    return path


@pytest.mark.parametrize(
    "line, reason",
    [
        (
            '{"messages": [{"role": "wizard", "content": "x"}, {"role": "assistant", "content": "y"}]}',
            "unknown role 'wizard'",
        ),
        (
            '{"messages": [{"role": "user"}, {"role": "assistant", "content": "y"}]}',
            "message 1 (user): missing 'content'",
        ),
        ('{"messages": []}', "empty conversation"),
        ('{"messages": [{"role": "user", "content": "x"}]}', "no assistant message"),
        ('{"text": "not a conversation"}', "missing required field 'messages'"),
    ],
)
def test_bad_conversations_are_one_line_errors_or_counted_skips(tmp_path, tokdir, capsys, line, reason):
    src = _bad(tmp_path, "bad", line)
    code, err = _cli(capsys, "shard", src, "--output", tmp_path / "out", "--tokenizer", tokdir, "--quiet")
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert f"{src}:2:" in err and reason in err
    code, err = _cli(
        capsys, "shard", src, "--output", tmp_path / "out2", "--tokenizer", tokdir, "--quiet", "--skip-errors", 1
    )
    assert code == 0, err
    skipped = [json.loads(x) for x in (tmp_path / "out2" / "skipped.jsonl").read_text().splitlines()]
    assert [(s["line"], reason in s["reason"]) for s in skipped] == [(2, True)]


def test_a_template_that_raises_names_file_and_line(tmp_path, capsys):
    strict = make_tokenizer_dir(tmp_path / "strict", TEMPLATE_STRICT)
    with_system = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "u"},
        {"role": "assistant", "content": "a"},
    ]
    src = write_jsonl(
        tmp_path / "c.jsonl", [{"messages": with_system}, {"messages": with_system[1:]}, {"messages": with_system}]
    )
    code, err = _cli(capsys, "shard", src, "--output", tmp_path / "out", "--tokenizer", strict, "--quiet")
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert f"{src}:2: the chat template raised" in err and "must start with a system message" in err
    assert not list((tmp_path / "out").glob("*.tar"))
    code, err = _cli(
        capsys, "shard", src, "--output", tmp_path / "out2", "--tokenizer", strict, "--quiet", "--skip-errors", 1
    )
    assert code == 0, err
    assert len(_members(tmp_path / "out2")) == 2


def test_chat_data_needs_a_tokenizer_directory_with_a_template(tmp_path, tokdir, capsys):
    src = write_jsonl(tmp_path / "c.jsonl", [{"messages": conversations(1)[0]}])
    code, err = _cli(capsys, "shard", src, "--output", tmp_path / "a", "--quiet")
    assert code == 2 and "needs --tokenizer DIR" in err
    code, err = _cli(
        capsys, "shard", src, "--output", tmp_path / "b", "--tokenizer", tokdir / "tokenizer.json", "--quiet"
    )
    assert code == 2 and "is a file" in err
    (tmp_path / "notemplate").mkdir()
    (tmp_path / "notemplate" / "tokenizer.json").write_bytes((tokdir / "tokenizer.json").read_bytes())
    code, err = _cli(
        capsys, "shard", src, "--output", tmp_path / "c", "--tokenizer", tmp_path / "notemplate", "--quiet"
    )
    assert code == 2 and "has no chat template" in err


def test_cp_split_carries_the_trained_labels(tmp_path, tokdir, capsys):
    """Each CP rank's labels are the trained labels of its chunks: together exactly the row's, none added."""
    from headrace.dataio.feed.cp_split import cp_merge, cp_split

    write_jsonl(tmp_path / "c.jsonl", [{"messages": c} for c in conversations(20, seed=11)])
    out = tmp_path / "shards"
    assert _cli(capsys, "shard", tmp_path / "c.jsonl", "--output", out, "--tokenizer", tokdir, "--quiet")[0] == 0
    batch = next(iter(_loader(out, packing="best_fit", seq_len=512, batch_size=2)))
    for cp in (2, 4):
        shards = cp_split(batch, cp)
        trained = [int((s["labels"] != IGNORE_INDEX).sum()) for s in shards]
        assert sum(trained) == int((batch["labels"] != IGNORE_INDEX).sum()) and min(trained) > 0
        merged = cp_merge(shards)
        assert merged["labels"].view(-1).tolist() == batch["labels"].view(-1).tolist()


def test_energon_reads_the_chat_shards(tmp_path, tokdir, capsys):
    """Megatron-Energon opens the shard directory as written (no `energon prepare`) and hands out the ids and the
    trained-token mask as the tars hold them."""
    from megatron.energon import (
        Cooker,
        DefaultTaskEncoder,
        Sample,
        WorkerConfig,
        get_loader,
        get_val_dataset,
        stateless,
    )
    from megatron.energon.edataclass import edataclass

    write_jsonl(tmp_path / "c.jsonl", [{"messages": c} for c in conversations(12, seed=12)])
    out = tmp_path / "shards"
    assert _cli(capsys, "shard", tmp_path / "c.jsonl", "--output", out, "--tokenizer", tokdir, "--quiet")[0] == 0

    @edataclass
    class Conversation(Sample):
        tokens: bytes
        trained: bytes

    @stateless
    def cook(crude: dict) -> Conversation:
        return Conversation(
            __key__=crude["__key__"],
            __restore_key__=crude["__restore_key__"],
            tokens=crude["npy"],
            trained=crude["trained.npy"],
        )

    class Encoder(DefaultTaskEncoder):
        decoder = None  # raw bytes: compare exactly what the shards hold
        cookers = [Cooker(cook)]

        def batch(self, batch):
            return batch

    wc = WorkerConfig(rank=0, world_size=1, num_workers=0)
    ds = get_val_dataset(out, split_part="train", worker_config=wc, batch_size=1, task_encoder=Encoder())
    got = {c.__key__: (c.tokens, c.trained) for batch in get_loader(ds) for c in batch}
    members = _members(out)
    assert got == {k: (m["npy"], m["trained.npy"]) for k, m in members.items()}
