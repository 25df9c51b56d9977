// Whether the test binary is built with AddressSanitizer (preset asan): such a build reserves
// terabytes of address space up front (no address-space cap fits it) and runs about 5 times
// slower, so some tests cap or slim themselves there.
#pragma once

namespace mpusim::testing {

#if defined(__SANITIZE_ADDRESS__)
inline constexpr bool kAddressSanitizer = true;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
inline constexpr bool kAddressSanitizer = true;
#else
inline constexpr bool kAddressSanitizer = false;
#endif
#else
inline constexpr bool kAddressSanitizer = false;
#endif

}  // namespace mpusim::testing
