# kvd/server.cmake — the daemon executable (included by kvd/CMakeLists.txt, which owns kvdcore).
pkg_check_modules(LIBZMQ REQUIRED IMPORTED_TARGET libzmq)
pkg_check_modules(LIBUV REQUIRED IMPORTED_TARGET libuv)
pkg_check_modules(JEMALLOC IMPORTED_TARGET jemalloc)

# The I/O side as a library so integration tools can reuse config/log without the daemon.
add_library(kvdserver STATIC server.c config.c log.c metrics.c fdpass.c zap.c events.c)
target_include_directories(kvdserver PUBLIC ${CMAKE_CURRENT_SOURCE_DIR})
target_link_libraries(kvdserver PUBLIC kvdcore kvproto PkgConfig::LIBZMQ PkgConfig::LIBUV
                      PkgConfig::SODIUM)

add_executable(kvd main.c)
target_link_libraries(kvd PRIVATE kvdserver)
# jemalloc is the daemon's allocator; sanitizer builds keep the sanitizer's own allocator.
if(JEMALLOC_FOUND AND NOT KVD_ASAN AND NOT KVD_TSAN AND NOT KVD_SAN_FLAGS)
  target_link_libraries(kvd PRIVATE PkgConfig::JEMALLOC)
endif()
