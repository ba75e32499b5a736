// The native layer stacks' Python classes (decoder.cpp): the target's `Decoder` and the draft's `DraftStack`,
// registered into the extension module by bindings.cpp.
#pragma once
#include <torch/extension.h>

void register_decoder(pybind11::module& m);
