"""A CPU model of `cuda_wgmma_balanced`'s work plan: shares, segments, partial slots and the cut list.

    python benchmarks/flashmla_decode_balanced_model.py

Transcribes the kernel's integer arithmetic (share_start, share_of, the decode kernel's walk over a
share's segments and the slot each partial goes to, the plan kernel's cut list, the merge's slots,
choose_parts) and checks, over random batches of 1 to 60 requests with 1 to 1,024 tiles and random or
chosen share counts, that every request is whole or cut and never both, that the cut list has at most
P - 1 entries, and that each cut request's merge reads slots its own parts wrote (or an empty share's
-inf) whose tile ranges cover the request once, in order. Prints the share counts chosen for a few
equal-length batches. Exits 1 on the first failure.
"""

import random
import sys


def share_start(part, total, parts):
    return part * total // parts


def share_of(tile, total, parts):
    return ((tile + 1) * parts - 1) // total


def choose_parts(blocks_per_request, batch, sms=132):
    most = max(1, min(65535, sms // blocks_per_request))
    parts = most
    while parts * 10 >= most * 9:
        if batch % parts == 0:
            return parts
        parts -= 1
    return most


def written_slots(tiles, parts):
    """Slot -> ('empty',) or ('part', request, first tile, end tile), as the decode kernel writes them."""
    prefix = [0]
    for n in tiles:
        prefix.append(prefix[-1] + n)
    total, written, whole = prefix[-1], {}, set()
    for c in range(parts):
        pos, stop = share_start(c, total, parts), share_start(c + 1, total, parts)
        if pos >= stop:
            written[2 * c] = ("empty",)
            continue
        b = max(i for i in range(len(tiles)) if prefix[i] <= pos)
        segment = 0
        while pos < stop:
            lo, hi = pos - prefix[b], min(stop - prefix[b], tiles[b])
            pos = prefix[b] + hi
            if lo == 0 and hi == tiles[b]:
                whole.add(b)
            else:
                slot = 2 * c + (segment > 0)
                assert slot not in written, f"slot {slot} written twice"
                written[slot] = ("part", b, lo, hi)
            segment, b = segment + 1, b + 1
    return prefix, written, whole


def check(tiles, parts):
    prefix, written, whole = written_slots(tiles, parts)
    total = prefix[-1]
    cuts = []
    for b in range(len(tiles)):
        first, last = share_of(prefix[b], total, parts), share_of(prefix[b + 1] - 1, total, parts)
        if first != last:
            cuts.append((b, first, last, int(share_start(first, total, parts) < prefix[b])))
    assert len(cuts) <= parts - 1, "more cuts than share boundaries"
    cut = {entry[0] for entry in cuts}
    assert cut | whole == set(range(len(tiles))) and not cut & whole, "a request neither or both whole and cut"
    for b, first, last, bit in cuts:
        covered = []
        for c in range(first, last + 1):
            slot = 2 * c + (bit if c == first else 0)
            part = written.get(slot)
            assert part is not None, f"request {b} would merge slot {slot}, which nothing wrote"
            if part[0] == "empty":
                continue
            assert part[1] == b, f"request {b} would merge request {part[1]}'s partial"
            covered.append(part[2:])
        end = 0
        for lo, hi in sorted(covered):
            assert lo == end, f"request {b}'s parts leave a gap or overlap at tile {end}"
            end = hi
        assert end == tiles[b], f"request {b}'s parts end at tile {end} of {tiles[b]}"


def main() -> int:
    rng = random.Random(1)
    try:
        for _ in range(30000):
            batch = rng.randint(1, 60)
            if rng.random() < 0.3:
                tiles = [rng.randint(1, 8)] * batch
            else:
                tiles = [rng.randint(1, rng.choice([1, 4, 64, 1024])) for _ in range(batch)]
            blocks_per_request = rng.choice([1, 2, 3, 4])
            parts = choose_parts(blocks_per_request, batch) if rng.random() < 0.5 else rng.randint(1, 300)
            check(tiles, parts)
    except AssertionError as exc:
        print(f"FAIL: {exc} (tiles {tiles}, {parts} shares)")
        return 1
    for batch in (1, 32, 64, 128, 256):
        print(f"batch {batch}: {choose_parts(1, batch)} shares at 16 heads, {choose_parts(2, batch)} at 128 heads")
    print("PASS: 30,000 random batches")
    return 0


if __name__ == "__main__":
    sys.exit(main())
