#include "glmtune/tensor/host_offload.h"

namespace glmtune {

#ifndef GLMTUNE_WITH_CUDA
HostOffload& HostOffload::of(Device device) {
  throw Error(fmt::format("activation offload to host memory asked for on {}, but this glmtune "
                          "was built without CUDA",
                          device.str()),
              "train.offload",
              "rebuild with -DGLMTUNE_CUDA=ON to train on a GPU; on the CPU offloaded layers are "
              "simply kept");
}
#endif

}  // namespace glmtune
