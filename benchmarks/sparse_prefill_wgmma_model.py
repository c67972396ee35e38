"""CPU model of the index arithmetic of the wgmma sparse prefill
(solutions/_shared/flashmla_sparse_prefill_cuda_wgmma/sparse_prefill_wgmma.cu).

    python benchmarks/sparse_prefill_wgmma_model.py

Transcribes the kernel's address and bit arithmetic into Python and checks it against independent
definitions, exiting 1 on the first mismatch:
  1. gather_half: every (kv row, 16-byte chunk, column block) of a tile lands where a TMA load with
     CU_TENSOR_MAP_SWIZZLE_128B of a 64 x 64 box puts it in the decode kernel's layout (column block cb
     at cb * 8192, byte x of a box at x ^ (((x >> 7) & 7) << 4)), from the right global bytes, and each
     buffer half is written exactly once, by the 128 threads of the warpgroup that owns it (WG0: latent
     [0, 256) and rope, WG1: latent [256, 512)); the halves are disjoint and cover the tile.
  2. the q copies: the same for q's 64 rows and nine column blocks, each chunk once over 256 threads.
  3. the validity bits: byte b bit e is entry 8 b + e; the uint2 of tile k read little-endian is the
     64 entries of the tile; scale_and_max's bit test picks the bit of the column each accumulator
     register holds (m64nNk16 layout: column 8 j + 2 (lane % 4) + (e & 1) of register 4 j + e).
  4. the tile list (ballot and popc over warp 0) is the ascending list of tiles with a valid entry.
  5. the pair schedule's arithmetic (two warpgroups, exchanged maxima, alpha / beta rescales, sums
     kept per group, the sink at the end) in float64 over listed tiles only, against the definition's
     math, including tokens whose tiles are partly or wholly invalid and tokens with no valid entry.
"""

import math
import sys

import numpy as np

TILE = 64
COL_BLOCK_BYTES = 8192
ROW_BYTES = 1152
HALF_COLS = 4


def tma_swizzle_128b(row: int, byte: int) -> int:
    """Offset inside a 64-row x 128-byte box written by TMA with SWIZZLE_128B (1024-byte aligned base)."""
    x = row * 128 + byte
    return x ^ (((x >> 7) & 7) << 4)


def decode_layout(row: int, col: int) -> int:
    """Byte offset of bf16 element (row, col) of a tile or of q in the decode kernel's shared layout."""
    cb, within = divmod(col, 64)
    return cb * COL_BLOCK_BYTES + tma_swizzle_128b(row, within * 2)


def gather_half_copies(half: int, lt: int):
    """(dst offset in the tile, tile row, source byte offset inside the kv row) of thread lt's copies."""
    r0, c = lt >> 3, lt & 7
    dst = r0 * 128 + ((c ^ (r0 & 7)) << 4)
    blocks = list(range(HALF_COLS)) + [2 * HALF_COLS] if half == 0 else list(range(HALF_COLS, 2 * HALF_COLS))
    for i in range(4):
        for cb in blocks:
            yield dst + i * 16 * 128 + cb * COL_BLOCK_BYTES, r0 + 16 * i, c * 16 + cb * 128


def q_copies(tid: int):
    """(dst offset in q's buffer, q row of the block, source byte offset inside the q row) of thread tid."""
    r0, c = tid >> 3, tid & 7
    dst = r0 * 128 + ((c ^ (r0 & 7)) << 4)
    for i in range(2):
        for cb in range(9):
            yield dst + i * 32 * 128 + cb * COL_BLOCK_BYTES, r0 + 32 * i, c * 16 + cb * 128


def check(condition: bool, what: str) -> None:
    if not condition:
        print(f"FAIL {what}")
        sys.exit(1)


def check_gather() -> None:
    owner = {}
    for half in (0, 1):
        for lt in range(128):
            for dst, row, src in gather_half_copies(half, lt):
                col = src // 2  # element column of the chunk's first value
                check(src % 16 == 0 and src + 16 <= ROW_BYTES, f"source chunk {src} inside the row")
                check(dst == decode_layout(row, col), f"half {half} thread {lt} row {row} col {col}: dst {dst} "
                      f"!= TMA {decode_layout(row, col)}")
                for k in range(16):  # the chunk's bytes stay consecutive under the swizzle
                    check(dst + k == decode_layout(row, col + k // 2) + k % 2, "chunk contiguous")
                check(dst not in owner, f"dst {dst} written twice")
                owner[dst] = (half, col)
    check(len(owner) == 9 * 64 * 8, f"tile covered: {len(owner)} chunks")
    for dst, (half, col) in owner.items():
        want = 0 if (col < 256 or col >= 512) else 1
        check(half == want, f"column {col} filled by half {half}, expected {want}")
    print("PASS gather_half: 4608 chunks, each once, TMA SWIZZLE_128B positions, halves as the readers need")


def check_q() -> None:
    seen = set()
    for tid in range(256):
        for dst, row, src in q_copies(tid):
            col = src // 2
            check(dst == decode_layout(row, col), f"q thread {tid} row {row} col {col}")
            check(dst not in seen, "q chunk twice")
            seen.add(dst)
    check(len(seen) == 9 * 64 * 8, "q covered")
    print("PASS q copies: 4608 chunks, each once, TMA SWIZZLE_128B positions")


def validity_bytes(valid: np.ndarray) -> bytes:
    """sm.valid as the prologue writes it: thread tid's byte, bit e = entry 8 tid + e."""
    out = bytearray(256)
    for tid in range(256):
        bits = 0
        for e in range(8):
            pos = 8 * tid + e
            if pos < len(valid) and valid[pos]:
                bits |= 1 << e
        out[tid] = bits
    return bytes(out)


def tile_mask(vbytes: bytes, tile: int):
    x = int.from_bytes(vbytes[8 * tile: 8 * tile + 4], "little")
    y = int.from_bytes(vbytes[8 * tile + 4: 8 * tile + 8], "little")
    return x, y


def check_bits(rng) -> None:
    for _ in range(50):
        valid = rng.random(2048) < rng.random()
        vbytes = validity_bytes(valid)
        for tile in range(32):
            x, y = tile_mask(vbytes, tile)
            for lane in range(32):
                c0 = 2 * (lane & 3)
                w_lo, w_hi = x >> c0, y >> c0
                for j in range(8):
                    for e in range(4):
                        w = w_lo if j < 4 else w_hi
                        bit = (w >> (8 * (j & 3) + (e & 1))) & 1
                        col = 8 * j + c0 + (e & 1)
                        check(bool(bit) == bool(valid[tile * 64 + col]),
                              f"mask bit tile {tile} lane {lane} j {j} e {e}")
        # the tile list of warp 0
        nonempty = [(tile_mask(vbytes, t)[0] | tile_mask(vbytes, t)[1]) != 0 for t in range(32)]
        ballot = sum(1 << t for t in range(32) if nonempty[t])
        tiles = [None] * 32
        for lane in range(32):
            if nonempty[lane]:
                tiles[bin(ballot & ((1 << lane) - 1)).count("1")] = lane
        n = bin(ballot).count("1")
        check(tiles[:n] == [t for t in range(32) if valid[64 * t: 64 * t + 64].any()], "tile list")
    print("PASS validity bits, accumulator column bit test and tile list on 50 random masks")


def pair_schedule(s2, v, tiles, sink_log2):
    """The kernel's per-CTA arithmetic in float64. s2: [rows, 64 * n] base-2 logits, -inf where invalid
    (the listed tiles only); v: [64 * n, dv]. Returns out, max_logits, lse (base 2)."""
    rows, dv = s2.shape[0], v.shape[1]
    n = len(tiles)
    if n == 0:
        return np.zeros((rows, dv)), np.full(rows, -np.inf), np.full(rows, -np.inf)
    o_left = np.zeros((rows, dv // 2))   # WG0's columns
    o_right = np.zeros((rows, dv // 2))  # WG1's columns
    m0_state = np.full(rows, -np.inf)    # WG0's m
    m1_state = np.full(rows, -np.inf)    # WG1's m
    l0 = np.zeros(rows)
    l1 = np.zeros(rows)
    half = dv // 2
    for j in range((n + 1) // 2):
        ke, ko = 2 * j, 2 * j + 1
        has_odd = ko < n
        se = s2[:, ke * 64:(ke + 1) * 64]
        ve = v[ke * 64:(ke + 1) * 64]
        # WG0
        m0 = np.maximum(m0_state, se.max(1))
        check(np.isfinite(m0).all(), "m0 finite on a listed tile")
        alpha0 = np.exp2(m0_state - m0)
        pe = np.exp2(se - m0[:, None])
        l0 = l0 * alpha0 + pe.sum(1)
        o_left = o_left * alpha0[:, None] + pe @ ve[:, :half]
        # WG1
        mx = np.full(rows, -np.inf)
        if has_odd:
            so = s2[:, ko * 64:(ko + 1) * 64]
            vo = v[ko * 64:(ko + 1) * 64]
            mx = so.max(1)
        m1 = np.maximum(m0, mx)
        alpha1 = np.exp2(m1_state - m1)
        beta = np.exp2(m0 - m1)
        s_odd = np.zeros(rows)
        o_right = o_right * alpha1[:, None] + (pe * beta[:, None]) @ ve[:, half:]
        if has_odd:
            po = np.exp2(so - m1[:, None])
            s_odd = po.sum(1)
            o_right += po @ vo[:, half:]
        l1 = l1 * alpha1 + s_odd
        # WG0 again
        o_left *= beta[:, None]
        l0 *= beta
        if has_odd:
            o_left += po @ vo[:, :half]
        m0_state = m1
        m1_state = m1
    l = l0 + l1
    lse = m1_state + np.log2(l)
    keep = 1.0 / (1.0 + np.exp2(sink_log2 - lse)) if sink_log2 is not None else np.ones(rows)
    out = np.concatenate([o_left, o_right], 1) * (keep / l)[:, None]
    return out, m1_state, lse


def check_schedule(rng) -> None:
    rows, dv, topk = 8, 16, 2048
    cases = 0
    for trial in range(40):
        kind = trial % 5
        if kind == 0:
            valid = rng.random(topk) < 0.5
        elif kind == 1:  # a fresh token: the first few valid, the rest -1
            valid = np.arange(topk) < rng.integers(1, 300)
        elif kind == 2:  # scattered tiles
            valid = np.repeat(rng.random(32) < 0.3, 64) & (rng.random(topk) < 0.7)
        elif kind == 3:  # topk_length 0 or nothing valid
            valid = np.zeros(topk, bool)
        else:  # topk_length cut inside a tile
            valid = (rng.random(topk) < 0.9) & (np.arange(topk) < rng.integers(0, topk))
        logits = rng.normal(size=(rows, topk)) * 3
        v = rng.normal(size=(topk, dv))
        sink = None if trial % 2 else rng.normal(size=rows) * 2
        sink_log2 = None if sink is None else sink * math.log2(math.e)
        if trial == 6:
            sink_log2 = np.full(rows, np.inf)
        tiles = [t for t in range(32) if valid[64 * t: 64 * t + 64].any()]
        idx = np.concatenate([np.arange(64 * t, 64 * t + 64) for t in tiles]) if tiles else np.zeros(0, int)
        s2 = np.where(valid[idx][None, :], logits[:, idx], -np.inf)
        vv = np.where(valid[idx][:, None], v[idx], 0.0)  # zero-filled rows
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            out, mx, lse = pair_schedule(s2, vv, tiles, sink_log2)
        # the definition's math on all entries
        if valid.any():
            lg = np.where(valid[None, :], logits, -np.inf)
            want_max = lg.max(1)
            w = np.exp2(lg - want_max[:, None])
            want_lse = want_max + np.log2(w.sum(1))
            want_out = (w @ np.where(valid[:, None], v, 0.0)) / w.sum(1)[:, None]
            if sink_log2 is not None:
                with np.errstate(over="ignore"):
                    want_out *= (1.0 / (1.0 + np.exp2(sink_log2 - want_lse)))[:, None]
        else:
            want_max = want_lse = np.full(rows, -np.inf)
            want_out = np.zeros((rows, dv))
        check(np.allclose(out, want_out, atol=1e-12), f"schedule out, trial {trial}")
        for got, expected, what in ((mx, want_max, "max_logits"), (lse, want_lse, "lse")):
            finite = np.isfinite(got)
            check(np.array_equal(np.isinf(got), np.isinf(expected)) and np.allclose(got[finite], expected[finite]),
                  f"schedule {what}, trial {trial}")
        cases += 1
    print(f"PASS pair schedule over listed tiles on {cases} index patterns "
          "(partial, fresh, scattered, empty, cut; sinks)")


def main() -> int:
    rng = np.random.default_rng(0)
    check_gather()
    check_q()
    check_bits(rng)
    check_schedule(rng)
    return 0


if __name__ == "__main__":
    sys.exit(main())
