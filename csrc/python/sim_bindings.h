// Bindings of the sim device (csrc/sim): torch_pipeline._C._sim_* and the Race / RaceError types.
#pragma once

#include <torch/csrc/utils/pybind.h>

namespace torch_pipeline {
namespace python {

void init_sim_bindings(pybind11::module& m);

}  // namespace python
}  // namespace torch_pipeline
