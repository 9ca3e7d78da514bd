// The fused RNN cells of the sim device.
//
// On PrivateUse1 devices PyTorch's LSTM and GRU cells (nn.LSTM, nn.GRU, nn.LSTMCell, nn.GRUCell)
// take the path of CUDA's: two matmuls, then one fused kernel for the gates. Those fused ops have
// kernels for CUDA only, so the fallback's CPU kernel does not exist. Here they are composed of
// aten ops on the sim tensors (each op checked and run by the fallback like any other), computing
// what CUDA's fused kernels compute, with the same workspace layout, so autograd's formulas for the
// fused ops (the backward kernels below) apply unchanged. The gate sums run in another order than
// the CPU's unfused cell (which adds each bias right after its matmul), so results agree with the
// CPU's to rounding, not bit for bit.
#include "extra_kernels.h"

#include <ATen/ATen.h>
#include <torch/library.h>

#include <optional>
#include <tuple>

namespace torch_pipeline {
namespace sim {
namespace {

bool has(const std::optional<at::Tensor>& t) { return t.has_value() && t->defined(); }

// input_gates + hidden_gates (+ both biases), as the fused kernels sum them.
at::Tensor gate_sum(const at::Tensor& input_gates, const at::Tensor& hidden_gates,
                    const std::optional<at::Tensor>& input_bias,
                    const std::optional<at::Tensor>& hidden_bias) {
  at::Tensor gates = input_gates + hidden_gates;
  if (has(input_bias)) {
    gates = gates + *input_bias;
  }
  if (has(hidden_bias)) {
    gates = gates + *hidden_bias;
  }
  return gates;
}

// Returns (hy, cy, workspace); workspace holds the activated gates [i, f, g, o] (batch x 4*hidden).
std::tuple<at::Tensor, at::Tensor, at::Tensor> lstm_cell(
    const at::Tensor& input_gates, const at::Tensor& hidden_gates, const at::Tensor& cx,
    const std::optional<at::Tensor>& input_bias, const std::optional<at::Tensor>& hidden_bias) {
  const auto chunks = gate_sum(input_gates, hidden_gates, input_bias, hidden_bias).chunk(4, 1);
  const at::Tensor i = chunks[0].sigmoid();
  const at::Tensor f = chunks[1].sigmoid();
  const at::Tensor g = chunks[2].tanh();
  const at::Tensor o = chunks[3].sigmoid();
  at::Tensor cy = f * cx + i * g;
  at::Tensor hy = o * cy.tanh();
  return {std::move(hy), std::move(cy), at::cat({i, f, g, o}, 1)};
}

// Returns (grad_gates, grad_cx, grad_bias) from the workspace of lstm_cell.
std::tuple<at::Tensor, at::Tensor, at::Tensor> lstm_cell_backward(
    const std::optional<at::Tensor>& grad_hy, const std::optional<at::Tensor>& grad_cy,
    const at::Tensor& cx, const at::Tensor& cy, const at::Tensor& workspace, bool has_bias) {
  if (!has(grad_hy) && !has(grad_cy)) {
    return {};
  }
  const auto gates = workspace.chunk(4, 1);
  const at::Tensor& i = gates[0];
  const at::Tensor& f = gates[1];
  const at::Tensor& g = gates[2];
  const at::Tensor& o = gates[3];
  const at::Tensor tanh_cy = cy.tanh();
  const at::Tensor go = has(grad_hy) ? *grad_hy : at::zeros_like(cy);
  at::Tensor gc = go * o * (1 - tanh_cy * tanh_cy);  // through hy = o * tanh(cy)
  if (has(grad_cy)) {
    gc = gc + *grad_cy;
  }
  at::Tensor grad_gates = at::cat({gc * g * (1 - i) * i, gc * cx * (1 - f) * f,
                                   gc * i * (1 - g * g), go * tanh_cy * (1 - o) * o},
                                  1);
  at::Tensor grad_bias = has_bias ? grad_gates.sum(0) : at::Tensor();
  return {std::move(grad_gates), gc * f, std::move(grad_bias)};
}

// Returns (hy, workspace); workspace holds [r, z, n, hx, hidden n-gate with bias] (batch x
// 5*hidden).
std::tuple<at::Tensor, at::Tensor> gru_cell(const at::Tensor& input_gates,
                                            const at::Tensor& hidden_gates, const at::Tensor& hx,
                                            const std::optional<at::Tensor>& input_bias,
                                            const std::optional<at::Tensor>& hidden_bias) {
  const at::Tensor in = has(input_bias) ? input_gates + *input_bias : input_gates;
  const at::Tensor hid = has(hidden_bias) ? hidden_gates + *hidden_bias : hidden_gates;
  const auto ic = in.chunk(3, 1);
  const auto hc = hid.chunk(3, 1);
  const at::Tensor r = (ic[0] + hc[0]).sigmoid();
  const at::Tensor z = (ic[1] + hc[1]).sigmoid();
  const at::Tensor n = (ic[2] + r * hc[2]).tanh();
  at::Tensor hy = n + z * (hx - n);
  return {std::move(hy), at::cat({r, z, n, hx, hc[2]}, 1)};
}

// Returns (grad_input_gates, grad_hidden_gates, grad_hx, grad_input_bias, grad_hidden_bias).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> gru_cell_backward(
    const at::Tensor& grad_hy, const at::Tensor& workspace, bool has_bias) {
  const auto w = workspace.chunk(5, 1);
  const at::Tensor& r = w[0];
  const at::Tensor& z = w[1];
  const at::Tensor& n = w[2];
  const at::Tensor& hx = w[3];
  const at::Tensor& hn = w[4];
  const at::Tensor gz = grad_hy * (hx - n) * (1 - z) * z;
  const at::Tensor gn = grad_hy * (1 - z) * (1 - n * n);
  const at::Tensor gr = gn * hn * (1 - r) * r;
  at::Tensor grad_input_gates = at::cat({gr, gz, gn}, 1);
  at::Tensor grad_hidden_gates = at::cat({gr, gz, gn * r}, 1);
  at::Tensor grad_input_bias = has_bias ? grad_input_gates.sum(0) : at::Tensor();
  at::Tensor grad_hidden_bias = has_bias ? grad_hidden_gates.sum(0) : at::Tensor();
  return {std::move(grad_input_gates), std::move(grad_hidden_gates), grad_hy * z,
          std::move(grad_input_bias), std::move(grad_hidden_bias)};
}

}  // namespace

void register_rnn_kernels(torch::Library& aten) {
  aten.impl("_thnn_fused_lstm_cell", TORCH_FN(lstm_cell));
  aten.impl("_thnn_fused_lstm_cell_backward_impl", TORCH_FN(lstm_cell_backward));
  aten.impl("_thnn_fused_gru_cell", TORCH_FN(gru_cell));
  aten.impl("_thnn_fused_gru_cell_backward", TORCH_FN(gru_cell_backward));
}

}  // namespace sim
}  // namespace torch_pipeline
