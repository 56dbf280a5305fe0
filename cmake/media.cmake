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
