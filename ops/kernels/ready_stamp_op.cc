// ReadyStamp: records when a tensor became ready; returns it unchanged.

#include "kernels/kernel_util.h"
#include "runtime.h"
#include "tensorflow/core/framework/op_kernel.h"

namespace prophet_tf {

using tensorflow::OpKernel;
using tensorflow::OpKernelConstruction;
using tensorflow::OpKernelContext;

class ReadyStampOp : public OpKernel {
 public:
  explicit ReadyStampOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("key", &key_));
  }

  void Compute(OpKernelContext* ctx) override {
    OP_REQUIRES(ctx, !IsConstantFolding(ctx), NotFoldable("ReadyStamp"));
    int64_t step = 0;
    OP_REQUIRES_OK(ctx, ReadStep("ReadyStamp", ctx->input(1), &step));
    RecordStamp(key_, step, PROPHET_STAMP_READY);
    ctx->set_output(0, ctx->input(0));  // forwards the buffer: no copy
  }

  // Cheap: lets the executor run it inline instead of via the thread pool.
  bool IsExpensive() override { return false; }

 private:
  int64_t key_;
};

// No TypeConstraint: the kernel is type-agnostic and serves every T of the op.
REGISTER_KERNEL_BUILDER(Name("ReadyStamp").Device(tensorflow::DEVICE_CPU), ReadyStampOp);

}  // namespace prophet_tf
