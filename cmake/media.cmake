# Image decoding libraries, all from Debian packages (scripts/install-deps.sh installs them):
# libjpeg-turbo (JPEG), libpng (PNG), libwebp + libwebpdemux (WebP, first frame of animations),
# giflib (GIF) and libexif (EXIF orientation). Exposed as one INTERFACE target so that the engine
# links them with a single line.
find_package(PkgConfig REQUIRED)
pkg_check_modules(GLMTUNE_JPEG REQUIRED IMPORTED_TARGET libjpeg)
pkg_check_modules(GLMTUNE_PNG REQUIRED IMPORTED_TARGET libpng)
pkg_check_modules(GLMTUNE_WEBP REQUIRED IMPORTED_TARGET libwebp libwebpdemux)
pkg_check_modules(GLMTUNE_EXIF REQUIRED IMPORTED_TARGET libexif)
# giflib ships no pkg-config file.
find_path(GLMTUNE_GIF_INCLUDE_DIR gif_lib.h REQUIRED)
find_library(GLMTUNE_GIF_LIBRARY NAMES gif REQUIRED)

add_library(glmtune_media_deps INTERFACE)
target_include_directories(glmtune_media_deps INTERFACE ${GLMTUNE_GIF_INCLUDE_DIR})
target_link_libraries(glmtune_media_deps
  INTERFACE PkgConfig::GLMTUNE_JPEG PkgConfig::GLMTUNE_PNG PkgConfig::GLMTUNE_WEBP
            PkgConfig::GLMTUNE_EXIF ${GLMTUNE_GIF_LIBRARY})

# Video decoding (FFmpeg: libavformat, libavcodec, libavutil, libswscale, also Debian packages).
# AUTO: on when the libraries are found; ON: required; OFF: builds without it, and every video
# input is then a glmtune::Error that says so. GLMTUNE_WITH_VIDEO=1 is defined when it is on.
set(GLMTUNE_VIDEO AUTO CACHE STRING "Decode videos with FFmpeg (AUTO, ON, OFF)")
set_property(CACHE GLMTUNE_VIDEO PROPERTY STRINGS AUTO ON OFF)
set(GLMTUNE_WITH_VIDEO OFF)
string(TOUPPER "${GLMTUNE_VIDEO}" _glmtune_video_mode)
if(_glmtune_video_mode STREQUAL "OFF")
  message(STATUS "glmtune: video decoding disabled (GLMTUNE_VIDEO=OFF)")
else()
  pkg_check_modules(GLMTUNE_FFMPEG IMPORTED_TARGET libavformat libavcodec libavutil libswscale)
  if(GLMTUNE_FFMPEG_FOUND)
    set(GLMTUNE_WITH_VIDEO ON)
    message(STATUS "glmtune: video decoding with FFmpeg (libavcodec ${GLMTUNE_FFMPEG_libavcodec_VERSION})")
    target_link_libraries(glmtune_media_deps INTERFACE PkgConfig::GLMTUNE_FFMPEG)
    target_compile_definitions(glmtune_media_deps INTERFACE GLMTUNE_WITH_VIDEO=1)
  elseif(_glmtune_video_mode STREQUAL "ON")
    message(FATAL_ERROR "GLMTUNE_VIDEO=ON but the FFmpeg libraries were not found. Install "
                        "libavformat-dev libavcodec-dev libavutil-dev libswscale-dev "
                        "(scripts/install-deps.sh does) or configure with -DGLMTUNE_VIDEO=OFF.")
  else()
    message(STATUS "glmtune: FFmpeg libraries not found, building without video decoding")
  endif()
endif()
