// The translation unit that builds the unit tests' shared precompiled header
// (tests/CMakeLists.txt).
