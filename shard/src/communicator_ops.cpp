// The collectives of Communicator: byte views, size checks, c10d calls.
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include <numeric>
#include <vector>

#include "communicator_impl.h"
#include "shardema/shard/communicator.h"

namespace shardema {
namespace shard {
namespace {

// Every dtype moves as uint8: Gloo refused bf16 broadcasts (torch 1.13),
// and bytes make sender and receiver agree by size alone.
at::Tensor bytesOf(const at::Tensor& tensor, const char* op, const char* what,
                   const std::string& tag) {
  TORCH_CHECK_VALUE(tensor.defined(), "Communicator::", op, " of '", tag, "': ", what,
                    " is undefined");
  TORCH_CHECK_VALUE(tensor.device().is_cpu(), "Communicator::", op, " of '", tag, "': ", what,
                    " must be a CPU tensor, got ", tensor.device());
  TORCH_CHECK_VALUE(tensor.is_contiguous(), "Communicator::", op, " of '", tag, "': ", what,
                    " must be contiguous");
  at::Tensor flat = tensor.reshape({-1});
  if (flat.numel() == 0) {
    // Gloo's buffers want a real pointer even for zero bytes.
    return at::empty({1}, at::TensorOptions().dtype(at::kByte)).narrow(0, 0, 0);
  }
  return flat.scalar_type() == at::kByte ? flat : flat.view(at::kByte);
}

at::Tensor staged(const Communicator::Impl& impl, const at::Tensor& bytes) {
  return impl.stageOnCuda ? bytes.to(bytes.options().device(at::kCUDA)) : bytes;
}

void unstage(const Communicator::Impl& impl, const at::Tensor& host, const at::Tensor& device) {
  if (impl.stageOnCuda) {
    host.copy_(device);
  }
}

std::vector<at::Tensor> pieces(const at::Tensor& flat, int64_t count, int64_t size) {
  std::vector<at::Tensor> views;
  for (int64_t r = 0; r < count; ++r) {
    views.push_back(flat.narrow(0, r * size, size));
  }
  return views;
}

void checkRoot(const Communicator& comm, const char* op, int64_t root, const std::string& tag) {
  TORCH_CHECK_VALUE(root >= 0 && root < comm.worldSize(), "Communicator::", op, " of '", tag,
                    "': root must be in [0, ", comm.worldSize(), "), got ", root);
}

}  // namespace

void Communicator::allGather(const at::Tensor& input, const at::Tensor& output,
                             const std::string& tag) {
  at::Tensor in = bytesOf(input, "allGather", "input", tag);
  at::Tensor out = bytesOf(output, "allGather", "output", tag);
  const int64_t n = in.numel();
  TORCH_CHECK_VALUE(out.numel() == n * worldSize(), "Communicator::allGather of '", tag,
                    "': output must hold ", n * worldSize(), " bytes (", n, " x ", worldSize(),
                    " ranks), got ", out.numel());
  at::Tensor devIn = staged(*impl_, in);
  at::Tensor devOut = staged(*impl_, out);
  impl_->run("allGather", tag, out.numel(), [&] {
    std::vector<at::Tensor> inputs{devIn};
    std::vector<std::vector<at::Tensor>> outputs{pieces(devOut, worldSize(), n)};
    c10d::AllgatherOptions opts;
    opts.timeout = impl_->options.timeout;
    return impl_->group->allgather(outputs, inputs, opts);
  });
  unstage(*impl_, out, devOut);
}

void Communicator::gather(const at::Tensor& input, const at::Tensor& output, int64_t root,
                          const std::string& tag) {
  checkRoot(*this, "gather", root, tag);
  at::Tensor in = bytesOf(input, "gather", "input", tag);
  const int64_t n = in.numel();
  const bool receiving = rank() == root;
  at::Tensor out;
  if (receiving) {
    out = bytesOf(output, "gather", "output", tag);
    TORCH_CHECK_VALUE(out.numel() == n * worldSize(), "Communicator::gather of '", tag,
                      "': output must hold ", n * worldSize(), " bytes on the root, got ",
                      out.numel());
  }
  at::Tensor devIn = staged(*impl_, in);
  at::Tensor devOut = receiving ? staged(*impl_, out) : at::Tensor();
  impl_->run("gather", tag, n * worldSize(), [&] {
    std::vector<at::Tensor> inputs{devIn};
    std::vector<std::vector<at::Tensor>> outputs;
    if (receiving) {
      outputs.push_back(pieces(devOut, worldSize(), n));
    }
    c10d::GatherOptions opts;
    opts.rootRank = root;
    opts.timeout = impl_->options.timeout;
    return impl_->group->gather(outputs, inputs, opts);
  });
  if (receiving) {
    unstage(*impl_, out, devOut);
  }
}

void Communicator::broadcast(const at::Tensor& tensor, int64_t root, const std::string& tag) {
  checkRoot(*this, "broadcast", root, tag);
  at::Tensor bytes = bytesOf(tensor, "broadcast", "tensor", tag);
  at::Tensor dev = staged(*impl_, bytes);
  impl_->run("broadcast", tag, bytes.numel(), [&] {
    std::vector<at::Tensor> tensors{dev};
    c10d::BroadcastOptions opts;
    opts.rootRank = root;
    opts.timeout = impl_->options.timeout;
    return impl_->group->broadcast(tensors, opts);
  });
  if (rank() != root) {
    unstage(*impl_, bytes, dev);
  }
}

void Communicator::allToAll(const at::Tensor& input, const at::Tensor& output,
                            const std::vector<int64_t>& inputSplits,
                            const std::vector<int64_t>& outputSplits, const std::string& tag) {
  at::Tensor in = bytesOf(input, "allToAll", "input", tag);
  at::Tensor out = bytesOf(output, "allToAll", "output", tag);
  const auto checkSplits = [&](const std::vector<int64_t>& splits, const at::Tensor& bytes,
                               const char* what) {
    TORCH_CHECK_VALUE(static_cast<int64_t>(splits.size()) == worldSize(),
                      "Communicator::allToAll of '", tag, "': ", what,
                      " needs one entry per rank (", worldSize(), "), got ", splits.size());
    int64_t total = 0;
    for (int64_t split : splits) {
      TORCH_CHECK_VALUE(split >= 0, "Communicator::allToAll of '", tag, "': negative ", what);
      total += split;
    }
    TORCH_CHECK_VALUE(total == bytes.numel(), "Communicator::allToAll of '", tag, "': ", what,
                      " sum to ", total, " bytes but the tensor holds ", bytes.numel());
  };
  checkSplits(inputSplits, in, "inputSplits");
  checkSplits(outputSplits, out, "outputSplits");
  at::Tensor devIn = staged(*impl_, in);
  at::Tensor devOut = staged(*impl_, out);
  impl_->run("allToAll", tag, in.numel() + out.numel(), [&] {
    std::vector<int64_t> inSplits = inputSplits;
    std::vector<int64_t> outSplits = outputSplits;
    c10d::AllToAllOptions opts;
    opts.timeout = impl_->options.timeout;
    return impl_->group->alltoall_base(devOut, devIn, outSplits, inSplits, opts);
  });
  unstage(*impl_, out, devOut);
}

void Communicator::allReduceSum(const at::Tensor& tensor, const std::string& tag) {
  TORCH_CHECK_VALUE(tensor.defined() && tensor.device().is_cpu() && tensor.is_contiguous(),
                    "Communicator::allReduceSum of '", tag,
                    "': the tensor must be a defined, contiguous CPU tensor");
  TORCH_CHECK_VALUE(tensor.scalar_type() == at::kFloat || tensor.scalar_type() == at::kDouble,
                    "Communicator::allReduceSum of '", tag, "': float32 or float64 only, got ",
                    tensor.scalar_type());
  if (tensor.numel() == 0) return;
  at::Tensor dev = staged(*impl_, tensor);
  impl_->run("allReduceSum", tag, tensor.nbytes(), [&] {
    std::vector<at::Tensor> tensors{dev};
    c10d::AllreduceOptions opts;  // the default op is SUM
    opts.timeout = impl_->options.timeout;
    return impl_->group->allreduce(tensors, opts);
  });
  unstage(*impl_, tensor, dev);
}

void Communicator::barrier(const std::string& tag) {
  impl_->run("barrier", tag, 0, [&] {
    c10d::BarrierOptions opts;
    opts.timeout = impl_->options.timeout;
    return impl_->group->barrier(opts);
  });
}

}  // namespace shard
}  // namespace shardema
