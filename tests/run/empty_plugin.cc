// A shared library that is not a backend plugin (no entry points); the loader must say so.
extern "C" __attribute__((visibility("default"))) int mpusim_test_not_a_plugin() { return 0; }
