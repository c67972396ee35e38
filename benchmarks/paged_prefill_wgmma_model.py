"""CPU model of the index arithmetic of solutions/_shared/mla_paged_prefill_cuda_wgmma (no GPU needed).

    python benchmarks/paged_prefill_wgmma_model.py [--batches N]

Checks, as the kernel computes them:
  * slots: request b owns block slots [(qo_indptr[b] + 3b) / 4, (qo_indptr[b+1] + 3(b+1)) / 4), at least
    ceil(q_len / 4) of them; the reversed grid (slot = num_slots - 1 - blockIdx) with the 32-way warp search
    runs every (request, row block) exactly once, and every other slot exits (random batches, empty requests
    and more queries than keys included);
  * rows and limits: row r of block g is token 4g + r // 16, head r % 16, a thread's two accumulator rows
    share one token (its warp's), each row's visible key count is the reference's, and the block visits
    exactly the tiles its last valid token needs;
  * loads: the cp.async destinations (8 threads a 128-byte row segment, chunk c ^ (row % 8)) are where TMA
    SWIZZLE_128B puts each 16-byte chunk, each (row, chunk, column block) written once, half A (latent
    blocks 0-3 and rope) by WG0, half B (latent 4-7) by WG1; the page shuffle hands every thread the page of
    the rows it copies; the q copy covers the q tile likewise;
  * numerics: an fp32 model of the pair schedule (WG0 even tiles, WG1 odd, the running maxima m0/m1, the
    factors alpha/beta with the -inf guard, bf16 probabilities, zero-filled keys past key_end) against the
    reference on small batches.
Exits 1 on any failure.
"""

import math
import random
import sys

import torch

HEADS, ROWS, TOK, TILE = 16, 64, 4, 64
DV, DPE = 512, 64
COL_BLOCK_BYTES = 64 * 128


def slot_start(qo_indptr, b):
    return (qo_indptr[b] + 3 * b) // 4


def request_of(qo_indptr, batch, slot):
    """The kernel's 32-way warp search."""
    lo, hi = 0, batch
    while hi - lo > 1:
        step = (hi - lo + 31) // 32
        ok = [lo + lane * step < hi and slot_start(qo_indptr, lo + lane * step) <= slot for lane in range(32)]
        assert ok[0], "lane 0 must always hold"
        last = max(lane for lane in range(32) if ok[lane])
        assert all(ok[:last + 1]), "probes must be monotone"
        lo += last * step
        hi = min(hi, lo + step)
    return lo


def block_of(qo_indptr, kv_indptr, batch, total_q, block_idx):
    """(request, g) that CTA block_idx runs, or None for a spare slot; mirrors the kernel's prologue."""
    num_slots = (total_q + 3 * batch) // 4
    slot = num_slots - 1 - block_idx
    b = request_of(qo_indptr, batch, slot)
    q_len = qo_indptr[b + 1] - qo_indptr[b]
    g = slot - slot_start(qo_indptr, b)
    assert g >= 0
    if 4 * g >= q_len:
        return None
    return b, g


def check_slots(rng, batches) -> int:
    failures = 0
    for n in range(batches):
        batch = rng.choice([1, 2, 3, 7, 33, 100, 1500]) if n % 10 else rng.randint(1, 3000)
        q_lens = [rng.choice([0, 1, 2, 3, 4, 5, 7, 8, 9, 63, 64, 65, rng.randint(0, 300)]) for _ in range(batch)]
        qo = [0]
        for q in q_lens:
            qo.append(qo[-1] + q)
        total_q = qo[-1]
        num_slots = (total_q + 3 * batch) // 4
        seen, first = {}, {}
        for block_idx in range(num_slots):
            got = block_of(qo, None, batch, total_q, block_idx)
            if got is not None:
                seen[got] = seen.get(got, 0) + 1
                first.setdefault(got, block_idx)
        want = {(b, g) for b in range(batch) for g in range(-(-q_lens[b] // 4))}
        ok = set(seen) == want and all(v == 1 for v in seen.values())
        # at least ceil(q/4) slots per request, at most one spare
        for b in range(batch):
            owned = slot_start(qo, b + 1) - slot_start(qo, b)
            ok &= -(-q_lens[b] // 4) <= owned <= -(-q_lens[b] // 4) + 1
        # reversed: within a request, a later block (more keys) gets a smaller blockIdx
        ok &= all(first[(b, g)] < first[(b, g - 1)] for (b, g) in first if g > 0)
        if not ok:
            failures += 1
            print(f"FAIL slots: batch {batch}, q_lens {q_lens[:20]}...")
    print(f"{'PASS' if failures == 0 else 'FAIL'} slots: {batches} random batches, every block once, last first, "
          "spares exit")
    return failures


def check_rows_and_limits(rng) -> int:
    failures = 0
    for _ in range(2000):
        q_len = rng.randint(1, 40)
        kv_len = rng.choice([0, rng.randint(0, q_len), q_len, q_len + rng.randint(0, 200)])
        diag = kv_len - q_len
        for g in range(-(-q_len // 4)):
            t0 = 4 * g
            valid_tokens = min(4, q_len - t0)
            key_end = max(0, min(kv_len, diag + t0 + valid_tokens))
            n_tiles = -(-key_end // TILE)
            needed = 0
            for tid in range(256):
                lt, lane = tid % 128, tid % 32
                warp = lt // 32
                row_lo = warp * 16 + lane // 4
                limit = diag + t0 + warp + 1
                for row in (row_lo, row_lo + 8):
                    token = t0 + row // 16
                    if token != t0 + warp:
                        failures += 1
                    if row >= valid_tokens * 16:
                        continue
                    want = sum(1 for j in range(kv_len) if j <= diag + token)  # the reference's mask
                    got = sum(1 for j in range(n_tiles * TILE) if j < limit)  # the kernel's mask over visited keys
                    got_real = sum(1 for j in range(min(key_end, n_tiles * TILE)) if j < limit)
                    if want != got or want != got_real:
                        failures += 1
                    needed = max(needed, want)
            if n_tiles != -(-needed // TILE):
                failures += 1
    print(f"{'PASS' if failures == 0 else 'FAIL'} rows and causal limits ({failures} mismatches)")
    return failures


def tma_swizzle_128b(row, byte_in_row):
    """Byte offset TMA SWIZZLE_128B gives (row, byte) of a 64-row x 128-byte box at a 1024-byte-aligned base."""
    offset = row * 128 + byte_in_row
    return offset ^ (((offset >> 7) & 7) << 4)


def check_loads() -> int:
    failures = 0
    # KV tile: [buffer half][(row, chunk, cb)] -> writer
    written = {}
    for wg, half in ((0, 0), (1, 1)):
        for lt in range(128):
            lane, warp = lt % 32, lt // 32
            c, r0 = lt & 7, lt >> 3
            dst0 = r0 * 128 + ((c ^ (r0 & 7)) << 4)
            # page shuffle: this thread's row r0 + 16 i comes from lane (lane >> 3) + 4 i, which holds load_row
            for i in range(4):
                src_lane = (lane >> 3) + 4 * i
                held_row = 4 * warp + (src_lane & 3) + 16 * ((src_lane >> 2) & 3)
                if held_row != r0 + 16 * i:
                    failures += 1
                row = r0 + 16 * i
                blocks = [half * 4 + cb for cb in range(4)] + ([8] if half == 0 else [])
                for cb in blocks:
                    dst = dst0 + cb * COL_BLOCK_BYTES + i * 16 * 128
                    want = cb * COL_BLOCK_BYTES + tma_swizzle_128b(row, c * 16)
                    if dst != want:
                        failures += 1
                    key = (row, c, cb)
                    if key in written:
                        failures += 1
                    written[key] = wg
    every = {(r, c, cb) for r in range(64) for c in range(8) for cb in range(9)}
    if set(written) != every:
        failures += 1
    if any(written[(r, c, cb)] != (0 if cb < 4 or cb == 8 else 1) for (r, c, cb) in every):
        failures += 1
    # lanes 16-31 hold what lanes 0-15 hold; a warp's 16 held rows are exactly the rows it copies
    for warp in range(4):
        held = {4 * warp + (lane & 3) + 16 * ((lane >> 2) & 3) for lane in range(32)}
        copied = {((32 * warp + lane) >> 3) + 16 * i for lane in range(32) for i in range(4)}
        if held != copied:
            failures += 1
    # q tile: 256 threads, rows r0 and r0 + 32, nine column blocks
    q_written = set()
    for tid in range(256):
        c, r0 = tid & 7, tid >> 3
        for h in range(2):
            r = r0 + 32 * h
            for cb in range(9):
                dst = r * 128 + ((c ^ (r & 7)) << 4) + cb * COL_BLOCK_BYTES
                if dst != cb * COL_BLOCK_BYTES + tma_swizzle_128b(r, c * 16):
                    failures += 1
                q_written.add((r, c, cb))
    if q_written != every:
        failures += 1
    print(f"{'PASS' if failures == 0 else 'FAIL'} cp.async destinations = TMA SWIZZLE_128B, coverage, page shuffle")
    return failures


def bf16(x):
    return x.to(torch.bfloat16).float()


def exp2(x):
    return torch.exp2(x)


def model_block(qn, qp, ckv, kpe, q_len, kv_len, g, scale_log2):
    """fp32 model of one CTA: returns (out [rows, 512], lse2 [rows]) for its valid rows."""
    t0 = 4 * g
    valid_tokens = min(4, q_len - t0)
    rows = valid_tokens * 16
    diag = kv_len - q_len
    key_end = max(0, min(kv_len, diag + t0 + valid_tokens))
    n_tiles = -(-key_end // TILE)
    if n_tiles == 0:
        return torch.zeros(rows, DV), torch.full((rows,), -math.inf)
    q = torch.zeros(ROWS, DV + DPE)
    q[:rows, :DV] = qn[t0:t0 + valid_tokens].reshape(rows, DV)
    q[:rows, DV:] = qp[t0:t0 + valid_tokens].reshape(rows, DPE)
    keys = torch.zeros(n_tiles * TILE, DV + DPE)  # zero-filled past key_end
    keys[:key_end, :DV] = ckv[:key_end]
    keys[:key_end, DV:] = kpe[:key_end]
    limit = torch.tensor([diag + t0 + r // 16 + 1 for r in range(ROWS)])  # per row (padding rows too)

    def safe(m):
        return torch.where(m == -math.inf, torch.zeros_like(m), m)

    def tile_logits(k):
        s = q @ keys[k * TILE:(k + 1) * TILE].T
        cols = torch.arange(TILE)[None, :] + k * TILE
        return torch.where(cols < limit[:, None], s * scale_log2, torch.tensor(-math.inf))

    o_l = torch.zeros(ROWS, DV // 2)
    o_r = torch.zeros(ROWS, DV // 2)
    m = torch.full((ROWS,), -math.inf)
    l0 = torch.zeros(ROWS)
    l1 = torch.zeros(ROWS)
    for j in range((n_tiles + 1) // 2):
        ke, ko = 2 * j, 2 * j + 1
        has_odd = ko < n_tiles
        # WG0
        s = tile_logits(ke)
        m0 = torch.maximum(m, s.max(1).values)
        alpha0 = exp2(m - safe(m0))
        pe32 = exp2(s - safe(m0)[:, None])
        l0 = l0 * alpha0 + pe32.sum(1)
        pe = bf16(pe32)
        o_l = o_l * alpha0[:, None] + pe @ keys[ke * TILE:(ke + 1) * TILE, :DV // 2]
        # WG1
        mx = tile_logits(ko).max(1).values if has_odd else torch.full((ROWS,), -math.inf)
        m1 = torch.maximum(m0, mx)
        alpha1 = exp2(m - safe(m1))
        beta = exp2(m0 - safe(m1))
        pe_b = bf16(pe * beta[:, None])
        o_r = o_r * alpha1[:, None] + pe_b @ keys[ke * TILE:(ke + 1) * TILE, DV // 2:DV]
        l1 = l1 * alpha1
        if has_odd:
            so = tile_logits(ko)
            po32 = exp2(so - safe(m1)[:, None])
            l1 = l1 + po32.sum(1)
            po = bf16(po32)
            o_r = o_r + po @ keys[ko * TILE:(ko + 1) * TILE, DV // 2:DV]
        # WG0 again
        o_l = o_l * beta[:, None]
        l0 = l0 * beta
        if has_odd:
            o_l = o_l + po @ keys[ko * TILE:(ko + 1) * TILE, :DV // 2]
        m = m1
    lsum = l0 + l1
    inv = torch.where(lsum > 0, 1 / torch.where(lsum > 0, lsum, torch.ones_like(lsum)), torch.zeros_like(lsum))
    out = torch.cat([o_l, o_r], 1) * inv[:, None]
    lse2 = m + torch.log2(lsum)
    return out[:rows], lse2[:rows]


def check_numerics(rng) -> int:
    sys_path_root = __file__.rsplit("/benchmarks/", 1)[0]
    sys.path.insert(0, sys_path_root)
    from references.mla_paged import mla_paged_prefill_causal_h16_ckv512_kpe64_ps1 as ref  # noqa: E402

    failures = 0
    torch.manual_seed(0)
    cases = [([5], [5]), ([3], [130]), ([1], [1]), ([9], [4]), ([7, 0, 12, 1], [0, 3, 200, 65]), ([70], [70]),
             ([17, 2], [150, 2])]
    scale = 1 / math.sqrt(576)
    for q_lens, kv_lens in cases:
        qo = [0]
        kv = [0]
        for q, k in zip(q_lens, kv_lens):
            qo.append(qo[-1] + q)
            kv.append(kv[-1] + k)
        total_q, total_kv = qo[-1], kv[-1]
        pages = total_kv + 5
        qn = torch.randn(total_q, HEADS, DV).bfloat16()
        qp = torch.randn(total_q, HEADS, DPE).bfloat16()
        ckv = torch.randn(pages, 1, DV).bfloat16()
        kpe = torch.randn(pages, 1, DPE).bfloat16()
        indices = torch.randperm(pages)[:total_kv].to(torch.int32)
        want_out, want_lse = ref.run(qn, qp, ckv, kpe, torch.tensor(qo, dtype=torch.int32),
                                     torch.tensor(kv, dtype=torch.int32), indices, scale)
        out = torch.full((total_q * HEADS, DV), math.nan)
        lse = torch.full((total_q * HEADS,), math.nan)
        batch = len(q_lens)
        for block_idx in range((total_q + 3 * batch) // 4):
            got = block_of(qo, kv, batch, total_q, block_idx)
            if got is None:
                continue
            b, g = got
            q_len, kv_len = qo[b + 1] - qo[b], kv[b + 1] - kv[b]
            idx = indices[kv[b]:kv[b + 1]].long()
            o, l2 = model_block(qn[qo[b]:qo[b + 1]].float(), qp[qo[b]:qo[b + 1]].float(),
                                ckv[idx, 0].float(), kpe[idx, 0].float(), q_len, kv_len, g, scale * math.log2(math.e))
            row0 = (qo[b] + 4 * g) * HEADS
            out[row0:row0 + o.shape[0]] = bf16(o)
            lse[row0:row0 + o.shape[0]] = l2
        out = out.view(total_q, HEADS, DV)
        lse = lse.view(total_q, HEADS)
        out_err = (out - want_out.float()).abs()
        ok = bool((out_err <= 1e-2 + 2e-2 * want_out.float().abs()).all())
        finite = torch.isfinite(want_lse)
        ok &= bool((torch.isfinite(lse) == finite).all())
        ok &= bool(((lse - want_lse).abs()[finite] <= 1e-3).all())
        ok &= bool((out[~finite] == 0).all())
        print(f"{'PASS' if ok else 'FAIL'} numerics q_lens {q_lens} kv_lens {kv_lens}: "
              f"out max error {out_err.nan_to_num(1e9).max():.3g}, "
              f"lse max error {(lse - want_lse).abs()[finite].nan_to_num(1e9).max() if finite.any() else 0:.3g}")
        failures += not ok
    return failures


def main(argv) -> int:
    batches = int(argv[argv.index("--batches") + 1]) if "--batches" in argv else 40
    rng = random.Random(0)
    failures = check_slots(rng, batches) + check_rows_and_limits(rng) + check_loads() + check_numerics(rng)
    print("ALL PASS" if failures == 0 else f"{failures} FAILURES")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
