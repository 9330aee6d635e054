# find_package(braid <version>): the same version check as for Braid.
include("${CMAKE_CURRENT_LIST_DIR}/BraidConfigVersion.cmake")
