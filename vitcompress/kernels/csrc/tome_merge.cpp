// ToMe's bipartite soft matching and size-weighted merge in one op, at inference (CPU).
//
// The same computation as vitcompress.method.merge: bipartite_soft_matching (unit metric rows,
// the even tokens' cosine to the odd ones, protected rows and columns at -inf, each even token's
// first best odd token, the r best by a stable descending sort, the rest ascending) and then
// merge_tokens (sums weighted by the tokens' sizes, in ToMe's order, divided by the summed
// sizes). The method's path runs about thirty small ATen ops per block; here one pass per image
// normalises, one batched matrix product scores the pairs, and one pass per image matches and
// merges.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include "norm.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <vector>

namespace {

constexpr float kNormFloor = 1e-12f;  // the method's clamp_min on a metric row's norm

}  // namespace

using vitcompress::norm_of;

// x: (B, T, C); metric: (B, T, D); sizes: (B, T) or undefined (all 1). `r` merged tokens
// (already clamped by merge_count, >= 1, T >= 2), `protected_tokens` never merged.
// Returns the merged tokens (B, T - r, C) in x's dtype, their sizes (B, T - r) float32 and the
// sequence index each came from (B, T - r) (a merged token its destination's), in ToMe's order:
// the protected tokens, then the other unmerged even tokens, then the other odd tokens.
std::vector<at::Tensor> tome_merge(const at::Tensor& x_in, const at::Tensor& metric_in,
                                   const c10::optional<at::Tensor>& sizes_in, int64_t r,
                                   int64_t protected_tokens) {
  TORCH_CHECK(x_in.device().is_cpu() && metric_in.device().is_cpu(), "tome_merge: CPU only");
  TORCH_CHECK(x_in.dim() == 3 && metric_in.dim() == 3, "tome_merge: x and metric are (B, T, .)");
  const int64_t B = x_in.size(0), T = x_in.size(1), C = x_in.size(2), D = metric_in.size(2);
  TORCH_CHECK(metric_in.size(0) == B && metric_in.size(1) == T,
              "tome_merge: metric must have one row per token");
  const int64_t TA = (T + 1) / 2, TB = T / 2, P = protected_tokens;
  const int64_t PA = (P + 1) / 2, PB = P / 2;
  TORCH_CHECK(TB >= 1 && r >= 1 && r <= TA - PA && P >= 0 && P <= T,
              "tome_merge: r or protected_tokens out of range");
  const int64_t U = TA - r, OUT = T - r;

  const at::Tensor x = x_in.to(at::kFloat).contiguous();
  const at::Tensor metric = metric_in.to(at::kFloat).contiguous();
  const bool has_sizes = sizes_in.has_value() && sizes_in->defined();
  at::Tensor sizes;
  if (has_sizes) {
    TORCH_CHECK(sizes_in->dim() == 2 && sizes_in->size(0) == B && sizes_in->size(1) == T,
                "tome_merge: sizes must be (B, T)");
    sizes = sizes_in->to(at::kFloat).contiguous();
  }
  const auto options = x.options();
  at::Tensor unit_a = at::empty({B, TA, D}, options);
  at::Tensor unit_b = at::empty({B, TB, D}, options);
  const float* mp = metric.data_ptr<float>();
  float* ap = unit_a.data_ptr<float>();
  float* bp = unit_b.data_ptr<float>();

  // Pass 1, per image: unit rows of the metric, even tokens to `a`, odd ones to `b`.
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      for (int64_t t = 0; t < T; ++t) {
        const float* row = mp + (b * T + t) * D;
        const float norm = std::max(norm_of(row, D), kNormFloor);
        float* unit = (t % 2 == 0) ? ap + (b * TA + t / 2) * D : bp + (b * TB + t / 2) * D;
        for (int64_t d = 0; d < D; ++d) unit[d] = row[d] / norm;
      }
    }
  });
  const at::Tensor scores = at::bmm(unit_a, unit_b.transpose(1, 2));  // (B, TA, TB)
  const float* sp = scores.data_ptr<float>();

  at::Tensor out = at::empty({B, OUT, C}, options);
  at::Tensor out_sizes = at::empty({B, OUT}, options);
  at::Tensor index = at::empty({B, OUT}, options.dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  const float* szp = has_sizes ? sizes.data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  float* osp = out_sizes.data_ptr<float>();
  int64_t* ip = index.data_ptr<int64_t>();
  const float minus_inf = -std::numeric_limits<float>::infinity();

  // Pass 2, per image: match, then merge in float32 as the method does.
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> best(TA);
    std::vector<int64_t> best_b(TA), order(TA);
    std::vector<float> merged(TB * C), merged_size(TB);
    for (int64_t b = begin; b < end; ++b) {
      // Each even token's first best odd token; protected rows and columns count as -inf.
      for (int64_t i = 0; i < TA; ++i) {
        const float* row = sp + (b * TA + i) * TB;
        float value = (i < PA || PB > 0) ? minus_inf : row[0];
        int64_t arg = 0;
        if (i >= PA) {
          for (int64_t j = 0; j < TB; ++j) {
            const float s = j < PB ? minus_inf : row[j];
            if (std::isnan(value)) break;  // torch.max keeps the first NaN
            if (std::isnan(s) || s > value) {
              value = s;
              arg = j;
            }
          }
        }
        best[i] = value;
        best_b[i] = arg;
      }
      // The r best even tokens by a stable descending sort (NaN first, as torch.sort).
      std::iota(order.begin(), order.end(), int64_t{0});
      std::stable_sort(order.begin(), order.end(), [&best](int64_t i, int64_t j) {
        if (std::isnan(best[i])) return !std::isnan(best[j]);
        if (std::isnan(best[j])) return false;
        return best[i] > best[j];
      });
      std::sort(order.begin() + r, order.end());  // the unmerged even tokens, ascending

      const float* xb = xp + b * T * C;
      const float* sb = has_sizes ? szp + b * T : nullptr;
      auto size_of = [sb](int64_t t) { return sb ? sb[t] : 1.f; };
      // Odd tokens, weighted by their sizes; the merged even tokens added in the sort's order
      // (scatter_add's order for each destination).
      for (int64_t j = 0; j < TB; ++j) {
        const int64_t t = 2 * j + 1;
        const float s = size_of(t);
        merged_size[j] = s;
        for (int64_t c = 0; c < C; ++c) merged[j * C + c] = xb[t * C + c] * s;
      }
      for (int64_t k = 0; k < r; ++k) {
        const int64_t t = 2 * order[k];
        const int64_t j = best_b[order[k]];
        const float s = size_of(t);
        merged_size[j] += s;
        for (int64_t c = 0; c < C; ++c) merged[j * C + c] += xb[t * C + c] * s;
      }
      // ToMe's order: protected tokens alternating even/odd, the other unmerged even tokens,
      // the other odd tokens. Each output token is its weighted sum divided by its size.
      float* ob = op + b * OUT * C;
      float* osb = osp + b * OUT;
      int64_t* ib = ip + b * OUT;
      int64_t slot = 0;
      auto put_even = [&](int64_t u) {
        const int64_t t = 2 * order[r + u];
        const float s = size_of(t);
        for (int64_t c = 0; c < C; ++c) ob[slot * C + c] = (xb[t * C + c] * s) / s;
        osb[slot] = s;
        ib[slot++] = t;
      };
      auto put_odd = [&](int64_t j) {
        const float s = merged_size[j];
        for (int64_t c = 0; c < C; ++c) ob[slot * C + c] = merged[j * C + c] / s;
        osb[slot] = s;
        ib[slot++] = 2 * j + 1;
      };
      for (int64_t t = 0; t < P; ++t) {
        if (t % 2 == 0) {
          put_even(t / 2);
        } else {
          put_odd(t / 2);
        }
      }
      for (int64_t u = PA; u < U; ++u) put_even(u);
      for (int64_t j = PB; j < TB; ++j) put_odd(j);
    }
  });
  return {out.to(x_in.scalar_type()), out_sizes, index};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("tome_merge", &tome_merge, "ToMe bipartite matching and merge (CPU, inference)");
}
