// A decode step's decoder layers in one call from Python (models/cpu_decode.py): the same kernels,
// in the same order, on the same inputs as the modules' path (models/llama.py through
// kernels/cpu_ops.py), so every value comes out with the same bits; what goes away is the
// Python between them (~270 module and ctypes calls a step, several ms at batch 1).
//
// Per layer (Llama family; bf16 activations; each linear layer's weights bf16 or in GGUF blocks,
// multiplied at the current ISA level; one new row per sequence):
//   normed, residual = rms_norm(x (+ residual))      input_layernorm
//   qkv = normed @ Wqkv^T; rotary on q, k and k, v into the pool
//   attn = decode attention of q over the pool;  o = attn @ Wo^T
//   normed, residual = rms_norm(o + residual)        post_attention_layernorm
//   x = (silu(gate) * up of normed @ Wgu^T) @ Wdown^T
// Qwen3's layers norm each head of q and k in place after the QKV projection (q_norm, k_norm:
// rms_norm over head_dim rows, as models/qwen3.py). A MoE layer (Qwen3-MoE) has, in place of
// the MLP: logits = normed @ Wrouter^T; the top-k experts and weights (ns_moe_topk); x = the
// experts' weighted sum (ns_moe_experts, kernels/cpu/moe.cpp), as layers/fused_moe.py calls them.
// With LoRA rows (lora/layers.py), each linear layer holding adapter slots then adds, as its
// LoRALinear.add_to does: out += ((in @ A^T) with every column but the row's slot's zeroed) @ B^T,
// the two GEMMs on A's and B's bf16 packings and one bf16 rounding of the sum, as torch's `+=`.
#include <algorithm>
#include <cstdint>

#include "bf16.h"

extern "C" {
int ns_rms_norm(int dtype, void* out, void* new_residual, const void* x, const void* residual, const void* weight,
                int64_t rows, int64_t hidden, float eps);
int ns_gemm_bf16(void* out, int64_t ldo, const void* x, int64_t ldx, const void* packed, const void* bias,
                     int64_t M, int64_t N, int64_t K);
int ns_rotary_store(int dtype, void* qkv, int64_t row_stride, int64_t num_tokens, int num_heads, int num_kv_heads,
                    int head_dim, const int64_t* positions, const float* cos_sin, int64_t cos_sin_stride,
                    void* key_cache, void* value_cache, int block_size, const int64_t* slots, int kv_format);
int ns_paged_attention_fp8(int dtype, int kv_format, void* out, const void* query, int64_t q_stride_token,
                           int64_t q_stride_head, const void* key_cache, const void* value_cache, int num_kv_heads,
                           int block_size, int head_dim, const int32_t* block_table, int64_t block_table_stride,
                           const int32_t* cu_seqlens_q, const int32_t* seq_lens, int num_seqs, int num_heads,
                           float scale, int rows_per_item, int amx_decode);
int ns_decode_attention_amx(void* out, const void* query, int64_t q_stride_token, int64_t q_stride_head,
                            const void* key_cache, const void* value_cache, int num_kv_heads, int head_dim,
                            const int32_t* block_table, int64_t block_table_stride, const int32_t* cu_seqlens_q,
                            const int32_t* seq_lens, int num_seqs, int num_heads, float scale);
int ns_paged_attention(int dtype, void* out, const void* query, int64_t q_stride_token, int64_t q_stride_head,
                       const void* key_cache, const void* value_cache, int num_kv_heads, int block_size, int head_dim,
                       const int32_t* block_table, int64_t block_table_stride, const int32_t* cu_seqlens_q,
                       const int32_t* seq_lens, int num_seqs, int num_heads, float scale, int rows_per_item);
int ns_silu_and_mul(int dtype, void* out, const void* gate_up, int64_t rows, int64_t inter);
int ns_gemm_quant(int format, void* out, int64_t ldo, const void* x, int64_t ldx, int dtype, const void* packed,
                  const void* bias, int64_t M, int64_t N, int64_t K);
int ns_moe_topk(int dtype, const void* logits, int64_t ld, int64_t tokens, int experts, int top_k, int renormalize,
                float* weights, int64_t* ids);
int ns_moe_experts(const int64_t* experts, int num_experts, void* out, const void* x, const int64_t* topk_ids,
                   const float* topk_weights, int64_t tokens, int top_k, int64_t hidden, int64_t inter,
                   void* scratch);
}

namespace {

constexpr int kMaxParts = 3;                          // a linear layer's runs of output columns
constexpr int kLinearEntries = 2 + 3 * kMaxParts;     // count, (format, weights, n) a part, input order
// A MoE layer's: the router as a linear, then the experts' table (moe.cpp; 0: a dense layer),
// the number of experts, top_k, renormalize, each expert's intermediate size.
constexpr int kMoeEntries = kLinearEntries + 5;
// 6 addresses (norms, pools, q_norm and k_norm or 0), Wqkv, Wo, Wgate_up, Wdown, then the MoE entries.
constexpr int kLayerEntries = 6 + 4 * kLinearEntries + kMoeEntries;
constexpr int kLoraEntries = 4;                       // a linear layer's LoRA: A, B packings, width, parts

// The step's LoRA rows: slot of each row (-1: the base model), slots and rank of every layer.
struct LoraRows {
    const int64_t* slots;
    int num_slots;
    int rank;
    uint16_t* shrink;  // scratch [rows, width]
    uint16_t* delta;   // scratch [rows, n]
};

// out[rows, n] += ((x @ A^T) masked to each row's slot) @ B^T, rounded once (lora/layers.py).
bool add_lora(const int64_t* entry, const LoraRows& lora, void* out, int64_t ldo, int64_t n, const void* x,
              int64_t ldx, int64_t rows, int64_t k) {
    const auto* a = reinterpret_cast<const void*>(entry[0]);
    const auto* b = reinterpret_cast<const void*>(entry[1]);
    const int64_t width = entry[2];
    const int parts = static_cast<int>(entry[3]);
    if (a == nullptr) return true;  // no adapter in this layer
    if (ns_gemm_bf16(lora.shrink, width, x, ldx, a, nullptr, rows, width, k) != 0) return false;
    // Keep each part's columns of the row's slot, [(part * slots + slot) * rank, + rank); zero the rest.
    for (int64_t r = 0; r < rows; ++r) {
        uint16_t* row = lora.shrink + r * width;
        const int64_t slot = lora.slots[r];
        int64_t zero_from = 0;
        for (int part = 0; slot >= 0 && part < parts; ++part) {
            const int64_t start = (static_cast<int64_t>(part) * lora.num_slots + slot) * lora.rank;
            std::fill(row + zero_from, row + start, uint16_t{0});
            zero_from = start + lora.rank;
        }
        std::fill(row + zero_from, row + width, uint16_t{0});
    }
    if (ns_gemm_bf16(lora.delta, n, lora.shrink, width, b, nullptr, rows, n, width) != 0) return false;
    for (int64_t r = 0; r < rows; ++r) {
        auto* o = static_cast<uint16_t*>(out) + r * ldo;
        const uint16_t* d = lora.delta + r * n;
        for (int64_t j = 0; j < n; ++j)
            o[j] = ns_bf16::from_float(ns_bf16::to_float(o[j]) + ns_bf16::to_float(d[j]));
    }
    return true;
}

// out[rows, ldo] = x @ W^T over W's parts side by side, each as the modules multiply it: format
// -1 the bf16 GEMM on cpu_ops.pack_gemm_weight's packing, else a GGUF format on
// quant.pack_weight's (kernels/cpu/gemm_quant.cpp). The entry's last value, when not 0, is the
// address of an int64 [k] input order (GPTQ's activation order, QuantizedWeight.input_perm): x's
// columns are gathered in it into `gathered` [rows, k] first, as the modules' index_select does.
// False when a GEMM refused its shapes.
bool linear(const int64_t* entry, void* out, int64_t ldo, const void* x, int64_t ldx, int64_t rows, int64_t k,
            uint16_t* gathered) {
    if (const auto* order = reinterpret_cast<const int64_t*>(entry[kLinearEntries - 1])) {
        const auto* in = static_cast<const uint16_t*>(x);
        for (int64_t r = 0; r < rows; ++r)
            for (int64_t j = 0; j < k; ++j) gathered[r * k + j] = in[r * ldx + order[j]];
        x = gathered;
        ldx = k;
    }
    int64_t column = 0;
    for (int part = 0; part < entry[0]; ++part) {
        const int format = static_cast<int>(entry[1 + 3 * part]);
        const auto* weights = reinterpret_cast<const void*>(entry[2 + 3 * part]);
        const int64_t n = entry[3 + 3 * part];
        void* o = static_cast<uint16_t*>(out) + column;
        const int code = format < 0 ? ns_gemm_bf16(o, ldo, x, ldx, weights, nullptr, rows, n, k)
                                    : ns_gemm_quant(format, o, ldo, x, ldx, 1, weights, nullptr, rows, n, k);
        if (code != 0) return false;
        column += n;
    }
    return true;
}

}  // namespace

extern "C" {

// layers: num_layers x kLayerEntries int64: the addresses of the input norm weight, the
// post-attention norm weight, the key pool, the value pool, the q_norm and k_norm weights (0
// without), then Wqkv, Wo, Wgate_up and Wdown as linear() reads them (no biases:
// models/cpu_decode.py leaves models with any to the modules), then the MoE entries (kMoeEntries;
// a table address of 0 for a dense layer, whose Wgate_up and Wdown are then used).
// buffers: 14 addresses of [rows, ...] tensors: x [H] (in: the embeddings; out: the last layer's
// MLP output), residual ping and pong [H], normed [H], o [H], qkv [qkv_n], attn [heads *
// head_dim], gate_up [2 * inter], act [inter], a scratch [max(H, heads * head_dim, inter)] for the
// inputs of layers with an input order (empty when no layer has one), all bf16; for MoE layers the
// router's logits bf16 [experts], the top-k weights fp32 [top_k] and ids int64 [top_k], and the
// experts' scratch (bf16, top_k * (2 * H + 3 * expert inter)), sized for the widest layer.
// kv_format: the pools' elements, 0 bf16, else an fp8 format (fp8.h).
// lora: null, or num_layers x 4 linears x kLoraEntries int64 (A's and B's packings, or 0 where the
// layer holds no adapter; the width; the parts), with lora_rows (each row's slot), lora_slots,
// lora_rank and two bf16 scratch buffers ([rows, widest width] and [rows, widest output]).
// Returns the index (1 or 2) of the buffer holding the residual after the last layer; 0 when a
// GEMM refused its shapes (nothing usable then; the caller runs the modules' path).
int ns_decode_layers(const int64_t* layers, int num_layers, const int64_t* buffers, int64_t rows, int64_t hidden,
                     int64_t qkv_n, int64_t inter, int num_heads, int num_kv_heads, int head_dim, float eps,
                     float scale, const int64_t* positions, const float* cos_sin, int64_t cos_sin_stride,
                     const int64_t* slots, int block_size, const int32_t* block_table, int64_t block_table_stride,
                     const int32_t* cu_seqlens_q, const int32_t* seq_lens, int amx_attention, int kv_format,
                     const int64_t* lora, const int64_t* lora_rows, int lora_slots, int lora_rank,
                     void* lora_shrink, void* lora_delta) {
    constexpr int kBf16 = 1;
    auto at = [](int64_t address) { return reinterpret_cast<void*>(address); };
    void* x = at(buffers[0]);
    void* residual[2] = {at(buffers[1]), at(buffers[2])};
    void* normed = at(buffers[3]);
    void* o = at(buffers[4]);
    void* qkv = at(buffers[5]);
    void* attn = at(buffers[6]);
    void* gate_up = at(buffers[7]);
    void* act = at(buffers[8]);
    auto* gathered = static_cast<uint16_t*>(at(buffers[9]));
    void* logits = at(buffers[10]);
    auto* topk_weights = static_cast<float*>(at(buffers[11]));
    auto* topk_ids = static_cast<int64_t*>(at(buffers[12]));
    void* moe_scratch = at(buffers[13]);
    const int64_t q_size = static_cast<int64_t>(num_heads) * head_dim;
    const int seqs = static_cast<int>(rows);
    const LoraRows lora_step{lora_rows, lora_slots, lora_rank, static_cast<uint16_t*>(lora_shrink),
                             static_cast<uint16_t*>(lora_delta)};
    // A linear layer, then its adapters' delta when the step has LoRA rows.
    auto project = [&](const int64_t* linear_entry, int which, int64_t layer, void* out, int64_t n, const void* in,
                       int64_t k) {
        if (!linear(linear_entry, out, n, in, k, rows, k, gathered)) return false;
        if (lora == nullptr) return true;
        const int64_t* entry = lora + (layer * 4 + which) * kLoraEntries;
        return add_lora(entry, lora_step, out, n, n, in, k, rows, k);
    };
    int current = -1;  // which residual buffer holds the residual; -1: x itself (layer 0)
    for (int layer = 0; layer < num_layers; ++layer) {
        const int64_t* w = layers + kLayerEntries * static_cast<int64_t>(layer);
        const int64_t* linears = w + 6;
        const int64_t* moe = linears + 4 * kLinearEntries;
        if (current < 0) {
            ns_rms_norm(kBf16, normed, nullptr, x, nullptr, at(w[0]), rows, hidden, eps);
        } else {
            ns_rms_norm(kBf16, normed, residual[1 - current], x, residual[current], at(w[0]), rows, hidden, eps);
            current = 1 - current;
        }
        if (!project(linears, 0, layer, qkv, qkv_n, normed, hidden)) return 0;
        for (int64_t r = 0; w[4] != 0 && r < rows; ++r) {  // each head of q and of k normed in place
            uint16_t* q_row = static_cast<uint16_t*>(qkv) + r * qkv_n;
            ns_rms_norm(kBf16, q_row, nullptr, q_row, nullptr, at(w[4]), num_heads, head_dim, eps);
            ns_rms_norm(kBf16, q_row + q_size, nullptr, q_row + q_size, nullptr, at(w[5]), num_kv_heads, head_dim,
                        eps);
        }
        void* key_cache = at(w[2]);
        void* value_cache = at(w[3]);
        ns_rotary_store(kBf16, qkv, qkv_n, rows, num_heads, num_kv_heads, head_dim, positions, cos_sin, cos_sin_stride,
                        key_cache, value_cache, block_size, slots, kv_format);
        if (kv_format != 0) {  // an fp8 pool (kernels/cpu/kv_fp8.cpp): the same kernels on widened copies
            if (ns_paged_attention_fp8(kBf16, kv_format, attn, qkv, qkv_n, head_dim, key_cache, value_cache,
                                       num_kv_heads, block_size, head_dim, block_table, block_table_stride,
                                       cu_seqlens_q, seq_lens, seqs, num_heads, scale, 16, amx_attention))
                return 0;
        } else if (!amx_attention || ns_decode_attention_amx(attn, qkv, qkv_n, head_dim, key_cache, value_cache,
                                                             num_kv_heads, head_dim, block_table, block_table_stride,
                                                             cu_seqlens_q, seq_lens, seqs, num_heads, scale)) {
            ns_paged_attention(kBf16, attn, qkv, qkv_n, head_dim, key_cache, value_cache, num_kv_heads, block_size,
                               head_dim, block_table, block_table_stride, cu_seqlens_q, seq_lens, seqs, num_heads,
                               scale, 16);
        }
        if (!project(linears + kLinearEntries, 1, layer, o, hidden, attn, q_size)) return 0;
        // Layer 0's residual is x itself (the embeddings); later layers' is a ping-pong buffer.
        const void* previous = current < 0 ? x : residual[current];
        const int next = current < 0 ? 0 : 1 - current;
        ns_rms_norm(kBf16, normed, residual[next], o, previous, at(w[1]), rows, hidden, eps);
        current = next;
        if (const auto* table = reinterpret_cast<const int64_t*>(moe[kLinearEntries])) {
            const int experts = static_cast<int>(moe[kLinearEntries + 1]);
            const int top_k = static_cast<int>(moe[kLinearEntries + 2]);
            if (!linear(moe, logits, experts, normed, hidden, rows, hidden, gathered)) return 0;
            if (ns_moe_topk(kBf16, logits, experts, rows, experts, top_k, static_cast<int>(moe[kLinearEntries + 3]),
                            topk_weights, topk_ids) != 0)
                return 0;
            if (ns_moe_experts(table, experts, x, normed, topk_ids, topk_weights, rows, top_k, hidden,
                               moe[kLinearEntries + 4], moe_scratch) != 0)
                return 0;
            continue;
        }
        if (!project(linears + 2 * kLinearEntries, 2, layer, gate_up, 2 * inter, normed, hidden)) return 0;
        ns_silu_and_mul(kBf16, act, gate_up, rows, inter);
        if (!project(linears + 3 * kLinearEntries, 3, layer, x, hidden, act, inter)) return 0;
    }
    return current + 1;
}
}  // extern "C"
