// A MoE layer's experts in one call from Python (kernels/fused_moe.fused_experts_cpu): the
// grouped path of kernels/fused_moe.py (fused_experts_grouped) with the same kernels in the same
// order on the same rows, so the output has the same bits; what goes away is the ~50 small torch
// ops and ctypes calls around them (sort by expert, gather, two GEMM calls, SiLU x mul, scatter,
// the top-k weighted sum slot by slot), which at batch 1 took longer than the experts' GEMMs.
//
// Per local row (token t, slot j) whose expert e = topk_ids[t, j] is on this rank (e >= 0):
//   act = silu(x[t] @ W13[e]^T gate half) * (up half)         bf16 after each kernel, as the modules
//   y[t, j] = act @ W2[e]^T                                   (bf16)
// out[t] = bf16(sum over j in order of fp32(y[t, j]) * w[t, j])  rows of remote experts are zeros
// Each weight is a bf16 packing (gemm*.cpp, format -1) or a quantized kernel format (gemm_quant.cpp);
// both give a row the same bits whatever other rows share its call.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "bf16.h"

extern "C" {
int ns_gemm_bf16(void* out, int64_t ldo, const void* x, int64_t ldx, const void* packed, const void* bias,
                 int64_t M, int64_t N, int64_t K);
int ns_gemm_quant(int format, void* out, int64_t ldo, const void* x, int64_t ldx, int dtype, const void* packed,
                  const void* bias, int64_t M, int64_t N, int64_t K);
int ns_silu_and_mul(int dtype, void* out, const void* gate_up, int64_t rows, int64_t inter);
}

namespace {

constexpr int64_t kParallelElements = int64_t(1) << 16;  // below: one thread for the copies and the sum

int expert_gemm(int64_t format, int64_t weights, void* out, const void* x, int64_t rows, int64_t n, int64_t k) {
    const auto* packed = reinterpret_cast<const void*>(weights);
    if (format < 0) return ns_gemm_bf16(out, n, x, k, packed, nullptr, rows, n, k);
    return ns_gemm_quant(static_cast<int>(format), out, n, x, k, 1, packed, nullptr, rows, n, k);
}

}  // namespace

extern "C" {

// The router's choice (kernels/fused_moe.fused_topk on CPU): per token, p = softmax(logits) in
// fp32 (the row's max subtracted, expf, the exponentials added in order, each divided by the
// sum), then the top_k largest p in descending order (an equal p: the lower expert first), each
// divided by their sum (added in that order) when renormalize. logits: dtype 0 fp32, 1 bf16,
// rows of stride ld. weights fp32 and ids int64 [tokens, top_k]. 0, or 2 for a bad argument.
int ns_moe_topk(int dtype, const void* logits, int64_t ld, int64_t tokens, int experts, int top_k, int renormalize,
                float* weights, int64_t* ids) {
    if ((dtype != 0 && dtype != 1) || top_k < 1 || top_k > experts) return 2;
#pragma omp parallel for schedule(static) if (tokens * experts >= kParallelElements)
    for (int64_t t = 0; t < tokens; ++t) {
        thread_local std::vector<float> p;
        thread_local std::vector<char> taken;
        p.resize(experts);
        taken.assign(experts, 0);
        for (int e = 0; e < experts; ++e)
            p[e] = dtype == 0 ? static_cast<const float*>(logits)[t * ld + e]
                              : ns_bf16::to_float(static_cast<const uint16_t*>(logits)[t * ld + e]);
        float top = p[0];
        for (int e = 1; e < experts; ++e) top = p[e] > top ? p[e] : top;
        float sum = 0.0f;
        for (int e = 0; e < experts; ++e) {
            p[e] = std::exp(p[e] - top);
            sum += p[e];
        }
        for (int e = 0; e < experts; ++e) p[e] = p[e] / sum;
        float* w = weights + t * top_k;
        int64_t* id = ids + t * top_k;
        for (int j = 0; j < top_k; ++j) {
            int best = -1;
            for (int e = 0; e < experts; ++e)
                if (!taken[e] && (best < 0 || p[e] > p[best])) best = e;
            taken[best] = 1;
            id[j] = best;
            w[j] = p[best];
        }
        if (renormalize) {
            float chosen = 0.0f;
            for (int j = 0; j < top_k; ++j) chosen += w[j];
            for (int j = 0; j < top_k; ++j) w[j] = w[j] / chosen;
        }
    }
    return 0;
}

// experts: num_experts x 4 int64, per local expert (W13's format, its packing's address, W2's
// format, its packing's address); W13 [2 * inter, hidden] (gate rows, then up), W2 [hidden, inter].
// x, out: bf16 [tokens, hidden]; topk_ids int64 and topk_weights fp32 [tokens, top_k] (ids local,
// -1 for an expert of another rank). scratch: bf16, at least tokens * top_k * (2 * hidden + 3 *
// inter) elements. Returns 0, or non-zero (nothing usable in out) when an id is out of range or a
// GEMM refused its shapes.
int ns_moe_experts(const int64_t* experts, int num_experts, void* out, const void* x, const int64_t* topk_ids,
                   const float* topk_weights, int64_t tokens, int top_k, int64_t hidden, int64_t inter,
                   void* scratch) {
    const int64_t flat = tokens * top_k;
    // Rows sorted by expert, stably (a token's rows keep their order), as moe_align's argsort.
    std::vector<int64_t> offsets(num_experts + 1, 0), order(flat), where(flat, -1);
    for (int64_t i = 0; i < flat; ++i) {
        const int64_t e = topk_ids[i];
        if (e >= num_experts || e < -1) return 3;
        if (e >= 0) ++offsets[e + 1];
    }
    for (int e = 0; e < num_experts; ++e) offsets[e + 1] += offsets[e];
    std::vector<int64_t> cursor(offsets.begin(), offsets.end() - 1);
    for (int64_t i = 0; i < flat; ++i)
        if (topk_ids[i] >= 0) {
            where[i] = cursor[topk_ids[i]]++;
            order[where[i]] = i;
        }
    const int64_t local = offsets[num_experts];
    auto* gathered = static_cast<uint16_t*>(scratch);  // [local, hidden]
    uint16_t* gate_up = gathered + local * hidden;     // [local, 2 * inter]
    uint16_t* act = gate_up + local * 2 * inter;       // [local, inter]
    uint16_t* down = act + local * inter;              // [local, hidden]
    const auto* in = static_cast<const uint16_t*>(x);
#pragma omp parallel for schedule(static) if (local * hidden >= kParallelElements)
    for (int64_t r = 0; r < local; ++r)
        std::memcpy(gathered + r * hidden, in + (order[r] / top_k) * hidden, hidden * sizeof(uint16_t));
    // Each expert's run of rows through its matrix (the table's column 0: W13, 2: W2): [rows, n]
    // of `to` from [rows, k] of `from`. False when a GEMM refused its shapes.
    auto each_expert = [&](int column, const uint16_t* from, int64_t k, uint16_t* to, int64_t n) {
        for (int e = 0; e < num_experts; ++e) {
            const int64_t first = offsets[e], rows = offsets[e + 1] - offsets[e];
            if (rows > 0 && expert_gemm(experts[4 * e + column], experts[4 * e + column + 1], to + first * n,
                                        from + first * k, rows, n, k) != 0)
                return false;
        }
        return true;
    };
    if (!each_expert(0, gathered, hidden, gate_up, 2 * inter)) return 2;
    if (local > 0 && ns_silu_and_mul(1, act, gate_up, local, inter) != 0) return 2;
    if (!each_expert(2, act, inter, down, hidden)) return 2;
    // The weighted sum, slot by slot in fp32: a product rounded, then the add (combine_topk's
    // `out += rows * w`; compiled without contraction into FMAs).
    auto* o = static_cast<uint16_t*>(out);
#pragma omp parallel for schedule(static) if (tokens * hidden * top_k >= kParallelElements)
    for (int64_t t = 0; t < tokens; ++t) {
        thread_local std::vector<float> sum;
        sum.resize(hidden);
        for (int j = 0; j < top_k; ++j) {
            const int64_t row = where[t * top_k + j];
            const float w = topk_weights[t * top_k + j];
            const uint16_t* y = row >= 0 ? down + row * hidden : nullptr;
            if (j == 0 && y == nullptr)
                for (int64_t c = 0; c < hidden; ++c) sum[c] = 0.0f * w;
            else if (j == 0)
                for (int64_t c = 0; c < hidden; ++c) sum[c] = ns_bf16::to_float(y[c]) * w;
            else if (y == nullptr)
                for (int64_t c = 0; c < hidden; ++c) sum[c] = sum[c] + 0.0f * w;
            else
                for (int64_t c = 0; c < hidden; ++c) sum[c] = sum[c] + ns_bf16::to_float(y[c]) * w;
        }
        for (int64_t c = 0; c < hidden; ++c) o[t * hidden + c] = ns_bf16::from_float(sum[c]);
    }
    return 0;
}

}  // extern "C"
