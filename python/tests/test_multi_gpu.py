"""Context parallelism on two GPUs: one process per GPU (torch.distributed over NCCL), each
rotating its two chunks of every packed sequence with ``rope_rs.apply_rope(..., cu_seqlens=,
cp_size=2, cp_rank=rank)`` inside a packed-sequence attention block.

The rotation is checked bit for bit: the ranks' rotated q and k, gathered and put back in
sequence order, equal one GPU's rotation of the whole sequences, and so do the gradients that
reach q and k (gathered) against one GPU's backward rotation of the gathered gradients of the
rotated q and k. The attention output, whose reductions run in another order on two ranks, is
checked against one GPU's block within a tolerance.

Skipped, with a message, on fewer than two GPUs (also under ROPE_REQUIRE_GPU=1: a one-GPU
machine cannot run it), and without torch or CUDA as the other GPU tests are.
"""

import os
import socket
import time

import pytest

from gpu_gate import cuda_torch

torch = cuda_torch()
if torch.cuda.device_count() < 2:
    pytest.skip(
        f"SKIPPED (one GPU): the context-parallel test needs two, found {torch.cuda.device_count()}",
        allow_module_level=True,
    )

import torch.distributed as dist  # noqa: E402
import torch.distributed.nn.functional as dist_fn  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

import rope_rs  # noqa: E402

CP = 2
# Whole lengths of the packed sequences, each divisible by 2 * CP.
LENGTHS = [12, 64, 4, 200, 36]
HQ, HK, D, THETA = 4, 2, 128, 500000.0
# Seconds the ranks get to finish (a rank stuck in a collective fails the test).
RANK_DEADLINE_S = 120
# NVLink multicast stays off on shared hosts (NCCL, PyTorch's symmetric memory, NVSHMEM).
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def rank_tokens(rank):
    """Indices, into the whole packed sequences, of `rank`'s tokens in its own order: for each
    sequence, chunk `rank` then chunk `2 CP - 1 - rank` of its `2 CP` equal chunks."""
    index, start = [], 0
    for n in LENGTHS:
        c = n // (2 * CP)
        for chunk in (rank, 2 * CP - 1 - rank):
            index += range(start + chunk * c, start + (chunk + 1) * c)
        start += n
    return torch.tensor(index)


def whole_inputs(dtype, device):
    """q, k, v of the whole sequences and the gradient of the block's output, the same on
    every rank (drawn on the CPU from one seed)."""
    g = torch.Generator().manual_seed(1234)
    t = sum(LENGTHS)
    draw = [torch.randn(t, h, D, generator=g) for h in (HQ, HK, HK, HQ)]
    return [x.to(dtype).to(device) for x in draw]


def attention(q, k, v, q_index):
    """Causal attention within each packed sequence: query rows `q_index` (token indices into
    the whole sequences) against every key of the whole sequences; GQA heads repeated."""
    seq_of = torch.repeat_interleave(torch.arange(len(LENGTHS)), torch.tensor(LENGTHS)).to(q.device)
    tokens = torch.arange(sum(LENGTHS), device=q.device)
    qi = q_index.to(q.device)
    allowed = (seq_of[qi][:, None] == seq_of[None, :]) & (tokens[None, :] <= qi[:, None])
    k, v = (x.repeat_interleave(HQ // HK, dim=1).float() for x in (k, v))
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) / D**0.5
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)


def block(q, k, v, q_index, cu, rotate):
    """The attention block: `rotate` q and k, then attention over the whole sequences' keys
    (`k`, `v` are the whole sequences' after `rotate`'s gather)."""
    q_rot, k_all, v_all = rotate(q, k, v)
    return attention(q_rot, k_all, v_all, q_index), q_rot, k_all


def in_sequence_order(parts, rank_index):
    """The ranks' tensors `parts` (in each rank's own token order) put back in the whole
    sequences' order."""
    out = torch.empty((sum(LENGTHS),) + parts[0].shape[1:], dtype=parts[0].dtype, device=parts[0].device)
    for part, index in zip(parts, rank_index):
        out[index.to(out.device)] = part
    return out


def run_rank(rank, port, dtype_name, style):
    os.environ.update(NO_MULTICAST)
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=CP, device_id=dev)
    try:
        dtype = getattr(torch, dtype_name)
        q_whole, k_whole, v_whole, grad_whole = whole_inputs(dtype, dev)
        starts = [0]
        for n in LENGTHS:
            starts.append(starts[-1] + n)
        cu = torch.tensor(starts, dtype=torch.int32, device=dev)
        rank_index = [rank_tokens(r) for r in range(CP)]
        mine = rank_index[rank].to(dev)

        # This rank's block: its chunks rotated with cp_rank, then k and v gathered (with their
        # gradients) from every rank for the attention over whole sequences.
        def rotate_cp(q, k, v):
            q_rot, k_rot = rope_rs.apply_rope(
                q, k, cu_seqlens=cu, cp_size=CP, cp_rank=rank, theta=THETA, style=style
            )
            k_all = in_sequence_order(dist_fn.all_gather(k_rot), rank_index)
            v_all = in_sequence_order(dist_fn.all_gather(v), rank_index)
            return q_rot, k_all, v_all

        q = q_whole[mine].clone().requires_grad_(True)
        k = k_whole[mine].clone().requires_grad_(True)
        v = v_whole[mine].clone().requires_grad_(True)
        out, q_rot, k_all = block(q, k, v, mine, cu, rotate_cp)
        q_rot.retain_grad()
        k_all.retain_grad()
        out.backward(grad_whole[mine])

        def gathered(x):
            parts = [torch.empty_like(x) for _ in range(CP)]
            dist.all_gather(parts, x.contiguous())
            return in_sequence_order(parts, rank_index)

        q_rot_all, out_all = gathered(q_rot.detach()), gathered(out.detach())
        dq_all, dk_all = gathered(q.grad), gathered(k.grad)
        dq_rot_all = gathered(q_rot.grad)
        # k_all's gradient is every rank's contribution to the whole sequences' rotated k;
        # the all_gather's backward sums them onto the owning rank: their sum is what reaches
        # the rotation.
        dk_rot_all = k_all.grad.clone()
        dist.all_reduce(dk_rot_all)

        if rank == 0:
            # One GPU, whole sequences: the same rotation, its backward on the gathered
            # gradients, and the same block.
            q_one, k_one = rope_rs.apply_rope(q_whole, k_whole, cu_seqlens=cu, theta=THETA, style=style)
            assert torch.equal(q_rot_all, q_one), "rotated q, gathered from two ranks, equals one GPU's bit for bit"
            assert torch.equal(k_all.detach(), k_one), "rotated k, gathered from two ranks, equals one GPU's bit for bit"
            dq_one, dk_one = rope_rs.apply_rope(
                dq_rot_all, dk_rot_all, cu_seqlens=cu, theta=THETA, style=style, backward=True
            )
            assert torch.equal(dq_all, dq_one), "q's gradient, gathered, equals one GPU's backward rotation bit for bit"
            assert torch.equal(dk_all, dk_one), "k's gradient, gathered, equals one GPU's backward rotation bit for bit"
            every = torch.arange(sum(LENGTHS))
            out_one = attention(q_one, k_one, v_whole, every)
            tol = {torch.float32: 1e-4, torch.bfloat16: 2e-2}[dtype]
            torch.testing.assert_close(out_all, out_one, atol=tol, rtol=tol)
            assert q_rot_all.isfinite().all() and not torch.equal(q_rot_all, q_whole), "the rotation ran"
        dist.barrier()
    except BaseException:
        # No teardown: the other rank may be waiting in a collective, which would hold this
        # one in destroy_process_group; the test's join ends both.
        raise
    dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("style", ["neox", "interleaved"])
@pytest.mark.parametrize("dtype_name", ["bfloat16", "float32"])
def test_two_rank_context_parallel_block_equals_one_gpu_bit_for_bit(dtype_name, style):
    os.environ.update(NO_MULTICAST)
    ranks = mp.spawn(run_rank, args=(free_port(), dtype_name, style), nprocs=CP, join=False)
    # join raises the first rank's exception (ending the other rank); a rank stuck in a
    # collective fails the test at the deadline instead of hanging it.
    deadline = time.monotonic() + RANK_DEADLINE_S
    while not ranks.join(timeout=1):
        if time.monotonic() > deadline:
            for process in ranks.processes:
                process.kill()
            pytest.fail(f"the ranks did not finish within {RANK_DEADLINE_S} s")
