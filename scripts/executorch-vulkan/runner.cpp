// A torch-free way to run an ExecuTorch LLM program from Python (ctypes), for the gateway's
// executorch engine.  The wheel's pybindings convert torch tensors and so need the exact torch the
// wheel was built with; this calls the wheel's libexecutorch.so (Module API) directly, so a worker
// serving a Vulkan program needs no torch at all.  One handle = one loaded method = one KV cache.
//
//   void* gw_et_load(path, method, err, errlen)            -> handle or NULL (err says why)
//   long  gw_et_forward(h, tokens, n, pos, out, cap, err, errlen)
//         feed n tokens at positions pos..pos+n-1; writes the n x vocab logits (float32) into out
//         (cap floats); returns the number written, or -1 (err says why)
//   void  gw_et_free(h)
//   int   gw_et_has_backend(name)                          -> 1 if registered with the runtime
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include <executorch/extension/module/module.h>
#include <executorch/extension/tensor/tensor.h>
#include <executorch/runtime/backend/interface.h>
#include <executorch/runtime/platform/runtime.h>

namespace {
using executorch::aten::ScalarType;
using executorch::extension::from_blob;
using executorch::extension::module::Module;
using executorch::runtime::Error;
using executorch::runtime::EValue;

struct Handle {
  std::unique_ptr<Module> module;
  std::string method;
};

void say(char* err, size_t len, const std::string& what) {
  if (err != nullptr && len > 0) {
    std::snprintf(err, len, "%s", what.c_str());
  }
}
}  // namespace

extern "C" {

void* gw_et_load(const char* path, const char* method, char* err, size_t errlen) {
  auto h = std::make_unique<Handle>();
  h->module = std::make_unique<Module>(path, Module::LoadMode::Mmap);
  h->method = method;
  const Error e = h->module->load_method(h->method);
  if (e != Error::Ok) {
    say(err, errlen, "loading method '" + h->method + "' of " + path + " failed: ExecuTorch error " +
                         std::to_string(static_cast<int>(e)));
    return nullptr;
  }
  return h.release();
}

long gw_et_forward(void* hp, const int64_t* tokens, long n, int64_t pos, float* out, long cap, char* err,
                   size_t errlen) {
  auto* h = static_cast<Handle*>(hp);
  std::vector<int64_t> ids(tokens, tokens + n);
  int64_t start = pos;
  auto ids_t = from_blob(ids.data(), {1, static_cast<int>(n)}, ScalarType::Long);
  auto pos_t = from_blob(&start, {1}, ScalarType::Long);
  auto result = h->module->execute(h->method, std::vector<EValue>{EValue(*ids_t), EValue(*pos_t)});
  if (!result.ok()) {
    say(err, errlen, "execute failed: ExecuTorch error " + std::to_string(static_cast<int>(result.error())));
    return -1;
  }
  const auto& outputs = result.get();
  if (outputs.empty() || !outputs[0].isTensor()) {
    say(err, errlen, "the method returned no tensor");
    return -1;
  }
  const auto& logits = outputs[0].toTensor();
  if (logits.scalar_type() != ScalarType::Float) {
    say(err, errlen, "logits are not float32");
    return -1;
  }
  const long count = static_cast<long>(logits.numel());
  if (count > cap) {
    say(err, errlen, "logits (" + std::to_string(count) + " floats) exceed the buffer (" + std::to_string(cap) + ")");
    return -1;
  }
  std::memcpy(out, logits.const_data_ptr<float>(), count * sizeof(float));
  return count;
}

void gw_et_free(void* hp) { delete static_cast<Handle*>(hp); }

int gw_et_has_backend(const char* name) {
  executorch::runtime::runtime_init();
  return executorch::runtime::get_backend_class(name) != nullptr ? 1 : 0;
}

}  // extern "C"
