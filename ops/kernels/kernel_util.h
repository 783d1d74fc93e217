// Helpers shared by the prophet_tf kernels.

#ifndef PROPHET_TF_OPS_KERNELS_KERNEL_UTIL_H_
#define PROPHET_TF_OPS_KERNELS_KERNEL_UTIL_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "tensorflow/core/framework/log_memory.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/framework/tensor_shape.h"

namespace prophet_tf {

// Reads a scalar int64 step; InvalidArgument naming the received shape otherwise.
inline absl::Status ReadStep(const char* op, const tensorflow::Tensor& t, int64_t* step) {
  if (!tensorflow::TensorShapeUtils::IsScalar(t.shape())) {
    return absl::InvalidArgumentError(absl::StrCat(op, ": step must be a scalar. Received: step.shape=",
                                                   t.shape().DebugString()));
  }
  *step = t.scalar<int64_t>()();
  return absl::OkStatus();
}

// The ops are not stateful (see ops.cc), so TensorFlow's constant folders may
// try to evaluate one whose inputs are all constants, once, at optimisation
// time, and replace it by its result: the stamp or push would happen once
// instead of every step, and AwaitParam would block the optimiser. Both
// folders run kernels without a step container (grappler's EvaluateNode also
// without a runner; the graph-level folder with CONSTANT_FOLDING_STEP_ID),
// while every real execution (eager or tf.function) has one. A kernel that
// fails in that context is simply not folded.
inline bool IsConstantFolding(tensorflow::OpKernelContext* ctx) {
  return ctx->step_container() == nullptr &&
         (ctx->runner() == nullptr ||
          ctx->step_id() == tensorflow::LogMemory::CONSTANT_FOLDING_STEP_ID);
}

inline absl::Status NotFoldable(const char* op) {
  return absl::UnimplementedError(
      absl::StrCat(op, " has side effects and must not be constant-folded; the op is kept."));
}

}  // namespace prophet_tf

#endif  // PROPHET_TF_OPS_KERNELS_KERNEL_UTIL_H_
