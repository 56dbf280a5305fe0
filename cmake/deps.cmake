# Third-party libraries, all from Debian packages (scripts/install-deps.sh installs them).
find_package(Threads REQUIRED)
find_package(OpenMP REQUIRED COMPONENTS CXX)
find_package(nlohmann_json 3.10 REQUIRED)
find_package(CLI11 REQUIRED)
find_package(fmt REQUIRED)
find_package(spdlog REQUIRED)
find_package(PkgConfig REQUIRED)
pkg_check_modules(PCRE2 REQUIRED IMPORTED_TARGET libpcre2-8)
pkg_check_modules(TOMLPP REQUIRED IMPORTED_TARGET tomlplusplus)
# xxHash (libxxhash-dev) for the per-tensor checksums of checkpoints. Used header-only
# (XXH_INLINE_ALL in io/checkpoint.cpp), so binaries do not need libxxhash at run time.
pkg_check_modules(XXHASH REQUIRED libxxhash)
# toml++ reports bad TOML by throwing. A binary with the C++ runtime linked in statically
# (GLMTUNE_STATIC_RUNTIME) cannot catch an exception thrown inside the shared libtomlplusplus (the
# two unwinders do not mix: the process aborts), so such builds compile toml++ into themselves.
add_library(glmtune_toml INTERFACE)
if(GLMTUNE_STATIC_RUNTIME)
  target_include_directories(glmtune_toml INTERFACE ${TOMLPP_INCLUDE_DIRS})
  target_compile_definitions(glmtune_toml INTERFACE TOML_HEADER_ONLY=1)
else()
  target_link_libraries(glmtune_toml INTERFACE PkgConfig::TOMLPP)
endif()
set(BLA_VENDOR OpenBLAS)
find_package(BLAS REQUIRED)
find_path(OPENBLAS_INCLUDE_DIR cblas.h PATH_SUFFIXES openblas openblas-pthread REQUIRED)
find_package(MPI COMPONENTS CXX)
if(GLMTUNE_TESTS)
  find_package(GTest REQUIRED)
endif()
if(GLMTUNE_BENCH)
  find_package(benchmark REQUIRED)
endif()
