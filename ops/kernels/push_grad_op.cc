// PushGrad: stamps readiness and hands the gradient to the engine's queue.

#include "kernels/kernel_util.h"
#include "runtime.h"
#include "tensorflow/core/framework/op_kernel.h"

namespace prophet_tf {

using tensorflow::AsyncOpKernel;
using tensorflow::OpKernelConstruction;
using tensorflow::OpKernelContext;

// An AsyncOpKernel so that a later version can apply back-pressure (wait for
// queue space) without holding a thread; today it calls done() at once.
class PushGradOp : public AsyncOpKernel {
 public:
  explicit PushGradOp(OpKernelConstruction* ctx) : AsyncOpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("key", &key_));
  }

  void ComputeAsync(OpKernelContext* ctx, DoneCallback done) override {
    OP_REQUIRES_ASYNC(ctx, !IsConstantFolding(ctx), NotFoldable("PushGrad"), done);
    int64_t step = 0;
    OP_REQUIRES_OK_ASYNC(ctx, ReadStep("PushGrad", ctx->input(2), &step), done);
    const int64_t now = RecordStamp(key_, step, PROPHET_STAMP_READY);
    // The queued Tensor shares the gradient's buffer (reference count).
    OP_REQUIRES_OK_ASYNC(ctx, EnqueueGrad(key_, step, ctx->input(1), now), done);
    done();
  }

  // Starting the op is cheap (the wait, if any, holds no thread): run it
  // inline on the thread that made it ready instead of hopping to the pool.
  bool IsExpensive() override { return false; }

 private:
  int64_t key_;
};

REGISTER_KERNEL_BUILDER(
    Name("PushGrad").Device(tensorflow::DEVICE_CPU).HostMemory("variable"), PushGradOp);

}  // namespace prophet_tf
