# find_package(braid): the same package as find_package(Braid).
include("${CMAKE_CURRENT_LIST_DIR}/BraidConfig.cmake")
