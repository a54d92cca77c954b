// Registration of the library: the CPU kernels of the ops whose schemas schema.cpp declares, and the TensorWatch and
// AdamPlan classes. (torch.library registration only: the library uses no Python C API.)
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

// Helper classes rather than ops: they have no schema of their own, and FusedAdam calls the adam_step_ op wherever
// a plan is not available (other backends, torch.compile). TensorWatch validates a bucket of any device; AdamPlan,
// a CPU bucket's watch and step.
TORCH_LIBRARY_FRAGMENT(ort_optim, m) {
  m.class_<TensorWatch>("TensorWatch")
      .def(torch::init<std::vector<at::Tensor>, std::vector<std::vector<at::Tensor>>, std::vector<at::Tensor>,
                       at::Tensor, std::vector<at::Tensor>>())
      .def("check", &TensorWatch::check);
  m.class_<AdamPlan>("AdamPlan")
      .def(torch::init<std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<at::Tensor>,
                       std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<at::Tensor>,
                       std::vector<at::Tensor>, std::vector<at::Tensor>, at::Tensor, std::vector<at::Tensor>,
                       std::vector<at::Tensor>>())
      .def("check", &AdamPlan::check)
      .def("step", &AdamPlan::step)
      .def("grad_stats", &AdamPlan::grad_stats)
      .def("unscalable_grad", &AdamPlan::unscalable_grad)
      .def("forget", &AdamPlan::forget);
}

}  // namespace ort_optim
