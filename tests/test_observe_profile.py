"""The profiler: kernel classification on names from real traces, the time-share arithmetic, and
`hopperlm profile` on CPU producing a Chrome trace and a top-ops table from the real training loop."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hopperlm.observe.kernels import (
    ATTENTION,
    COMM,
    COPY,
    ELEMENTWISE,
    GEMM,
    HOST,
    OTHER,
    KernelRow,
    busy_time,
    category_shares,
    classify,
    summary_line,
)

REPO = Path(__file__).resolve().parents[1]

# names as torch.profiler / nsys report them on H100s and A100s (cuBLAS, cuDNN, FlashAttention, inductor, NCCL)
CUDA_NAMES = {
    "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off_kernel__5x_cublas": GEMM,
    "nvjet_tst_128x256_64x4_1x2_h_bz_coopA_TNT": GEMM,
    "nvjet_tss_64x8_64x16_2x1_v_bz_splitK_TNT": GEMM,
    "sm80_xmma_gemm_f32f32_f32f32_f32_tn_n_tilesize64x256x8": GEMM,
    "ampere_bf16_s16816gemm_bf16_128x64_ldg8_f2f_stages_64x3_tn": GEMM,
    "void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_32x6_tn_align8>(cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_32x6_tn_align8::Params)": GEMM,
    "void splitKreduce_kernel<32, 16, int, float, __nv_bfloat16, float, __nv_bfloat16, true, false, false>(cublasSplitKParams<float>, float const*, __nv_bfloat16 const*, __nv_bfloat16*, float const*, float const*, __nv_bfloat16 const*, float const*, __nv_bfloat16*, void*, long, float*, int*)": GEMM,
    "gemmSN_TN_kernel": GEMM,
    "triton_tem_fused__to_copy_addmm_gelu_t_view_9": GEMM,
    "triton_tem_fused_mm_4": GEMM,
    "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4, false, false, cutlass::bfloat16_t, Flash_kernel_traits<128, 128, 64, 4, cutlass::bfloat16_t> >, false, true, false, false, true, true, false, false>(pytorch_flash::Flash_fwd_params)": ATTENTION,
    "void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits<128, 64, 128, 8, 2, 4, 2, false, false, cutlass::bfloat16_t, Flash_kernel_traits<128, 64, 128, 8, cutlass::bfloat16_t> >, true, false, false, false, false, true, false, false>(pytorch_flash::Flash_bwd_params)": ATTENTION,
    "void cutlass::device_kernel<flash::enable_sm90_or_later<flash::FlashAttnFwdSm90<cute::tuple<cute::C<128>, cute::C<128>, cute::C<128> >, cutlass::bfloat16_t, float, cutlass::arch::Sm90, true, false> > >(flash::FlashAttnFwdSm90<...>::Params)": ATTENTION,
    "fmha_cutlassF_bf16_aligned_64x64_rf_sm80(PyTorchMemEffAttention::AttentionKernel<cutlass::bfloat16_t, cutlass::arch::Sm80, true, 64, 64, 64, true, true>::Params)": ATTENTION,
    "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x64x128_4x1x1_kernel0_0": ATTENTION,
    "triton_tem_fused_flex_attention_backward_split_transpose_3": ATTENTION,
    "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>, at::detail::Array<char*, 1> >(int, at::native::FillFunctor<float>, at::detail::Array<char*, 1>)": ELEMENTWISE,
    "void at::native::elementwise_kernel<128, 4, at::native::gpu_kernel_impl_nocast<at::native::direct_copy_kernel_cuda(at::TensorIteratorBase&)::{lambda()#3}::operator()() const::{lambda()#7}::operator()() const::{lambda(float)#1}> >(int, at::native::gpu_kernel_impl_nocast<...>)": ELEMENTWISE,
    "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)::FusedOptimizerTensorListMetadata<4>, at::native::(anonymous namespace)::FusedAdamMathFunctor<float, 4, (at::native::ADAM_MODE)1, false>, double*, double, double, double, double, double, bool, double*, double*>(...)": ELEMENTWISE,
    "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::func_wrapper_t<float, at::native::sum_functor<float, float, float>::operator()(at::TensorIterator&)::{lambda(float, float)#1}>, unsigned int, float, 4, 4> >(at::native::ReduceOp<...>)": ELEMENTWISE,
    "void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float, at::native::(anonymous namespace)::LogSoftMaxForwardEpilogue>(float*, float const*, int)": ELEMENTWISE,
    "void at::native::(anonymous namespace)::CatArrayBatchedCopy<at::native::(anonymous namespace)::OpaqueType<2u>, unsigned int, 4, 64, 64>(...)": ELEMENTWISE,
    "void at::native::indexSelectLargeIndex<float, long, unsigned int, 2, 2, -2, true>(...)": ELEMENTWISE,
    "triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0": ELEMENTWISE,
    "triton_poi_fused_arange_ge_index_put_lift_fresh_0": ELEMENTWISE,
    "RMSNormKernel": ELEMENTWISE,
    "ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)": COMM,
    "ncclKernel_AllGather_RING_LL_Sum_int8_t(ncclDevComm*, unsigned long, ncclWork*)": COMM,
    "Memcpy HtoD (Pageable -> Device)": COPY,
    "Memcpy DtoD (Device -> Device)": COPY,
    "Memset (Device)": COPY,
}
# op names from a CPU profile of the debug model (hopperlm profile on this machine), plus distributed ones
CPU_NAMES = {
    "aten::mm": GEMM,
    "aten::addmm": GEMM,
    "aten::bmm": GEMM,
    "aten::baddbmm": GEMM,
    "aten::linear": GEMM,
    "aten::matmul": GEMM,
    "aten::_scaled_dot_product_flash_attention_for_cpu": ATTENTION,
    "aten::_scaled_dot_product_flash_attention_for_cpu_backward": ATTENTION,
    "aten::scaled_dot_product_attention": ATTENTION,
    "aten::_efficient_attention_forward": ATTENTION,
    "aten::mul": ELEMENTWISE,
    "aten::add_": ELEMENTWISE,
    "aten::silu_backward": ELEMENTWISE,
    "aten::_log_softmax": ELEMENTWISE,
    "aten::nll_loss_backward": ELEMENTWISE,
    "aten::index_select": ELEMENTWISE,
    "aten::_fused_rms_norm": ELEMENTWISE,
    "aten::_fused_adamw_": ELEMENTWISE,
    "aten::_foreach_mul_": ELEMENTWISE,
    "aten::embedding_dense_backward": ELEMENTWISE,
    "aten::copy_": COPY,
    "aten::_to_copy": COPY,
    "aten::view": OTHER,
    "aten::t": OTHER,
    "aten::empty_strided": OTHER,
    "aten::as_strided": OTHER,
    "autograd::engine::evaluate_function: MulBackward0": OTHER,
    "MmBackward0": OTHER,
    "ScaledDotProductFlashAttentionForCpuBackward0": OTHER,
    "Optimizer.step#AdamW.step": OTHER,
    "Optimizer.zero_grad#AdamW.zero_grad": OTHER,
    "cudaLaunchKernel": OTHER,
    "cudaMemcpyAsync": COPY,
    "ProfilerStep*": HOST,
    "c10d::allreduce_": COMM,
    "nccl:all_reduce": COMM,
    "gloo:all_reduce": COMM,
    "record_param_comms": COMM,
}


@pytest.mark.parametrize("name,category", list(CUDA_NAMES.items()) + list(CPU_NAMES.items()))
def test_classify_real_names(name, category):
    assert classify(name) == category


def test_busy_time_is_the_union_of_kernel_intervals():
    assert busy_time([]) == 0
    assert busy_time([(0, 10), (5, 15), (20, 30)]) == 25  # overlap counted once, the gap not at all
    assert busy_time([(20, 30), (0, 10), (2, 3)]) == 20  # order and nesting do not matter


def test_shares_and_summary_line():
    rows = [
        KernelRow("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_TNT", GEMM, 710.0, 100),
        KernelRow("flash_fwd_kernel", ATTENTION, 120.0, 10),
        KernelRow("vectorized_elementwise_kernel", ELEMENTWISE, 90.0, 500),
        KernelRow("(GPU idle within the steps)", "idle", 30.0, 5),
        KernelRow("Memcpy HtoD (Pageable -> Device)", COPY, 47.0, 5),
        KernelRow("some_tiny_kernel", OTHER, 3.0, 5),
    ]
    shares = category_shares(rows, 1000.0)
    assert list(shares)[:3] == [GEMM, ATTENTION, ELEMENTWISE]
    assert sum(shares.values()) == pytest.approx(1.0)
    assert summary_line(shares) == "GEMMs 71%, attention 12%, elementwise/norm 9%, memory copy 5%, idle 3%"


def test_profile_cli_on_cpu_writes_trace_and_table(shakespeare_bytes, tmp_path):
    run = tmp_path / "run"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "hopperlm",
            "profile",
            "configs/debug.yaml",
            "--data.path",
            str(shakespeare_bytes),
            "--run.out_dir",
            str(run),
            "--steps",
            "2",
            "--wait",
            "0",
            "--warmup",
            "1",
            "--memory-snapshot",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    out = result.stdout
    assert "memory snapshot: skipped (CPU run" in out
    assert "profile: 0 wait + 1 warm-up + 2 recorded steps" in out
    prof = run / "profile"
    trace = json.loads((prof / "trace.pt.trace.json").read_text())
    names = {e.get("name") for e in trace["traceEvents"]}
    assert "aten::mm" in names and sum(n.startswith("ProfilerStep#") for n in names if n) == 2
    report = json.loads((prof / "profile.json").read_text())
    assert report["device"] == "cpu" and report["steps"] == 2
    assert sum(report["shares"].values()) == pytest.approx(1.0)
    assert report["shares"][GEMM] > 0.05 and report["shares"][ATTENTION] > 0  # the model's matmuls and SDPA
    top = report["rows"][0]
    assert top["category"] in (GEMM, ELEMENTWISE) and top["count"] > 0
    # the printed table: header, rows with categories, the summary line, where the files are
    table_start = out.index("--- where the time goes (CPU ops, self time) ---")
    table = out[table_start:].splitlines()
    assert table[1].split() == ["share", "total", "ms", "calls", "mean", "us", "category", "name"]
    assert any("GEMM" in line and "aten::mm" in line for line in table)
    summary = next(line for line in table if line.startswith("time: "))
    assert "GEMMs" in summary and "%" in summary and summary[len("time: ") :] == report["summary"]
    assert (prof / "kernels.txt").read_text().rstrip().endswith(report["summary"])
    # the profile ran the loop without touching checkpoints or evaluating
    assert not (prof / "checkpoints").exists() and not (run / "checkpoints").exists()
