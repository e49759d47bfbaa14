"""LLM tokens: ragged token-id experience (RLHF/GRPO-style) in a FIFO on-policy queue.

    python examples/llm_tokens.py [--prompts 8] [--group 4] [--out DIR]
                                  (DIR default: $ARROWBUF_EXAMPLES_OUT or a temp dir)

Uses schemas/tokens.yaml: prompt and response token ids and per-token logprobs are variable-length list columns,
one row per completion. A fake "policy" writes groups of completions per prompt for three policy versions; the
example computes GRPO group advantages in SQL, counts tokens with Polars, pads a sampled batch straight from the
Arrow list offsets, and drains the queue through `ab.Loader` with `max_staleness=0`, which delivers only the newest
policy's completions, each exactly once. Writes `llm_tokens.json` to DIR.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import tempfile

import numpy as np
import pyarrow as pa

import arrowbuf as ab

VOCAB = 1000


def completions(rng: np.random.Generator, prompts: int, group: int, version: int) -> dict:
    """`prompts` prompts x `group` sampled completions; reward: share of response tokens below VOCAB / 2."""
    rows: dict[str, list] = {k: [] for k in ("prompt_tokens", "response_tokens", "logprobs", "reward")}
    for _ in range(prompts):
        prompt = rng.integers(0, VOCAB, int(rng.integers(4, 16)), dtype=np.int32)
        for _k in range(group):
            resp = rng.integers(0, VOCAB, int(rng.integers(5, 64)), dtype=np.int32)
            rows["prompt_tokens"].append(prompt)
            rows["response_tokens"].append(resp)
            rows["logprobs"].append(-rng.exponential(1.0, len(resp)).astype(np.float32))
            rows["reward"].append(float((resp < VOCAB // 2).mean()))
    n = prompts * group
    return {**rows, "reward": np.asarray(rows["reward"], np.float32), "done": np.ones(n, bool),
            "policy_version": np.full(n, version, np.int64)}


def pad(column: pa.ListArray, pad_id: int = -1) -> np.ndarray:
    """A ragged list column as a padded [B, max_len] matrix, built from the Arrow offsets (no Python loop)."""
    column = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    offsets = column.offsets.to_numpy()
    lengths = np.diff(offsets)
    values = column.flatten().to_numpy()
    out = np.full((len(lengths), int(lengths.max())), pad_id, dtype=values.dtype)
    rows = np.repeat(np.arange(len(lengths)), lengths)
    cols = np.arange(len(values)) - np.repeat(offsets[:-1] - offsets[0], lengths)
    out[rows, cols] = values
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--group", type=int, default=4, help="completions per prompt")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    # what this example imports beyond arrowbuf (the [demo] extra), checked before anything runs
    for module in ("duckdb", "pandas", "polars"):
        ab.errors.require(module, "demo")
    # a temporary folder only when no --out and no $ARROWBUF_EXAMPLES_OUT (a default made one on every run)
    args.out = args.out or os.environ.get("ARROWBUF_EXAMPLES_OUT") or tempfile.mkdtemp(prefix="arrowbuf-")
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(args.seed)
    schema = ab.load_schema("tokens")  # a schema shipped with arrowbuf (schemas/tokens.yaml)
    per_version = args.prompts * args.group
    result: dict[str, object] = {}
    with ab.ExperienceStore(schema, capacity=10 * per_version, sampler="fifo", seed=args.seed) as store:
        written = [completions(rng, args.prompts, args.group, v) for v in range(3)]
        for batch in written:
            store.extend(batch)
        assert len(store) == 3 * per_version

        # GRPO: advantage = reward - mean reward of the completions of the same prompt (DuckDB groups by the list)
        adv = store.sql(
            "SELECT policy_version, prompt_tokens, reward - avg(reward) OVER (PARTITION BY policy_version, "
            "prompt_tokens) AS advantage, len(response_tokens) AS n_tokens FROM experience ORDER BY seq")
        a = adv.column("advantage").to_numpy()
        by_group = a.reshape(3 * args.prompts, args.group)
        assert np.allclose(by_group.sum(1), 0, atol=1e-5)       # advantages centre within each group
        summary = store.sql(
            "SELECT policy_version, count(*) AS completions, sum(len(response_tokens)) AS response_tokens, "
            "round(avg(len(response_tokens)), 1) AS mean_len, round(avg(reward), 3) AS mean_reward "
            "FROM experience GROUP BY 1 ORDER BY 1")
        print("completions per policy version (DuckDB over the ragged columns):")
        print(summary.to_pandas().to_string(index=False))
        expect_tokens = sum(len(r) for b in written for r in b["response_tokens"])
        import polars as pl

        pl_tokens = int(store.to_polars().select(pl.col("response_tokens").list.len().sum()).item())
        assert pl_tokens == expect_tokens, (pl_tokens, expect_tokens)
        print(f"Polars: {pl_tokens} response tokens in all (matches what was written)")

        # on-policy: only the newest policy's completions, each once, padded for a model
        delivered: list[int] = []
        with ab.Loader(store, batch_size=args.group * 2, prefetch=1, max_staleness=0, policy_version=2,
                       timeout=2.0) as loader:
            for _ in range(per_version // (args.group * 2)):
                b = next(loader)
                versions = b.to_numpy()["policy_version"]
                assert (versions == 2).all(), versions
                tokens = pad(b.data.column("response_tokens"))
                lens = [len(x) for x in b.to_numpy()["response_tokens"]]
                assert tokens.shape == (len(b), max(lens)) and (tokens >= 0).sum() == sum(lens)
                delivered.extend(b.indices.tolist())
            try:
                next(loader)
                raise AssertionError("the queue should be empty of fresh completions")
            except ab.SampleTimeout:
                pass
        assert len(delivered) == len(set(delivered)) == per_version
        print(f"Loader(max_staleness=0): delivered {len(delivered)} completions of policy 2, each once; "
              f"{loader.metrics.stale_rows_dropped} stale rows dropped; padded batch {tokens.shape}")
        result = {"rows": 3 * per_version, "response_tokens": pl_tokens, "delivered": len(delivered),
                  "stale_dropped": loader.metrics.stale_rows_dropped,
                  "summary": summary.to_pylist()}
    (out / "llm_tokens.json").write_text(json.dumps(result, indent=2, default=float))
    print(f"ok: wrote {out / 'llm_tokens.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
