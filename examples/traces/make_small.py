#!/usr/bin/env python3
"""Writes examples/traces/small.jsonl: a small deterministic trace in the Mooncake format (one JSON object
a line: timestamp in ms, input_length, output_length, hash_ids), for serve_sim's tests.

Each hash id names one 512-token block together with its whole prefix (ids come from a trie of block
contents, as in Mooncake's traces). The requests reuse prefixes at different rates: five shared system
prompts with popularity 40 / 20 / 10 / 5 / 2 % (the rest start fresh), multi-turn sessions whose next
turn extends the previous one's blocks, and one-off requests. Every request stays under 48 blocks.

    python3 examples/traces/make_small.py > examples/traces/small.jsonl
"""
import json
import random
import sys

BLOCK = 512


def main():
    rng = random.Random(20250601)
    trie = {}
    next_id = [0]

    def ids_for(blocks):
        parent, out = -1, []
        for b in blocks:
            key = (parent, b)
            if key not in trie:
                trie[key] = next_id[0]
                next_id[0] += 1
            parent = trie[key]
            out.append(parent)
        return out

    systems = [[("sys", s, i) for i in range(n)] for s, n in enumerate([8, 6, 4, 3, 2])]
    weights = [0.40, 0.20, 0.10, 0.05, 0.02]
    sessions = []  # [blocks] of sessions that may come back
    fresh = [0]
    t = 0

    def new_blocks(n):
        out = [("own", fresh[0] + i) for i in range(n)]
        fresh[0] += n
        return out

    for _ in range(400):
        t += int(rng.expovariate(1 / 250.0)) + 1
        if sessions and rng.random() < 0.35:  # a returning turn, recent sessions more likely
            k = len(sessions) - 1 - min(int(rng.expovariate(1 / 3.0)), len(sessions) - 1)
            blocks = sessions[k] + new_blocks(rng.randint(1, 4))
            if len(blocks) > 40 or rng.random() < 0.25:
                sessions.pop(k)
            else:
                sessions[k] = blocks
        else:
            r, acc, prefix = rng.random(), 0.0, []
            for s, w in zip(systems, weights):
                acc += w
                if r < acc:
                    prefix = list(s)
                    break
            blocks = prefix + new_blocks(rng.randint(1, 12))
            if rng.random() < 0.3:
                sessions.append(blocks)
                if len(sessions) > 24:
                    sessions.pop(0)
        ids = ids_for(blocks)
        line = {
            "timestamp": t,
            "input_length": len(ids) * BLOCK - rng.randrange(0, BLOCK),
            "output_length": rng.randint(8, 400),
            "hash_ids": ids,
        }
        sys.stdout.write(json.dumps(line) + "\n")


if __name__ == "__main__":
    main()
