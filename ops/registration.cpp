// Registration of the CPU library: the CPU kernels of the ops whose schemas schema.cpp declares, and the AdamPlan
// class.
#include <torch/custom_class.h>
#include <torch/library.h>

#include "adam_plan.h"
#include "grad_stats.h"
#include "step.h"

namespace ort_optim {

TORCH_LIBRARY_IMPL(ort_optim, CPU, m) {
  m.impl("adam_step_", &adam_step_cpu);
  m.impl("grad_stats", &grad_stats_cpu);
}

// A CPU-only helper class rather than an op: it has no schema of its own, and FusedAdam calls the adam_step_ op
// wherever it is not available (other backends, torch.compile).
TORCH_LIBRARY_FRAGMENT(ort_optim, m) {
  m.class_<AdamPlan>("AdamPlan")
      .def(torch::init<std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<at::Tensor>,
                       std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<at::Tensor>,
                       std::vector<at::Tensor>, std::vector<at::Tensor>, at::Tensor, std::vector<at::Tensor>,
                       std::vector<int64_t>, std::vector<int64_t>>())
      .def("check", &AdamPlan::check)
      .def("step", &AdamPlan::step)
      .def("grad_stats", &AdamPlan::grad_stats);
}

}  // namespace ort_optim
