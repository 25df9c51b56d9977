// A backend plugin from "another build": it exports the ABI symbol with a number no mpusim
// uses, so the loader must refuse it (backend_plugin_test.cc). Built only for that test.
extern "C" {
__attribute__((visibility("default"))) extern const int mpusim_backend_abi;
const int mpusim_backend_abi = -7;
__attribute__((visibility("default"))) void mpusim_make_backend(const void*, void*) {}
}
