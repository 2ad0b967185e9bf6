# Included after find_package(Torch), by the build (ShardemaTorch.cmake) and
# by the installed package (shardemaConfig.cmake), so consumers get it too.
#
# torch's MKL config (share/cmake/Caffe2/public/mkl.cmake) sets the link
# directories of caffe2::mkl to ${MKL_ROOT}/lib/intel64, .../intel64_win and
# .../win-x64 even when MKL_ROOT is empty (pytorch/pytorch#73008). Every
# target linking torch then got -L/lib/intel64 and the RPATH
# /lib/intel64:/lib/intel64_win:/lib/win-x64. The folders that do not exist
# are dropped; PyPI's torch links MKL statically, so none is needed.
if(TARGET caffe2::mkl)
  get_target_property(_shardema_mkl_dirs caffe2::mkl INTERFACE_LINK_DIRECTORIES)
  if(_shardema_mkl_dirs)
    set(_shardema_kept_dirs "")
    foreach(_shardema_dir IN LISTS _shardema_mkl_dirs)
      if(IS_DIRECTORY "${_shardema_dir}")
        list(APPEND _shardema_kept_dirs "${_shardema_dir}")
      endif()
    endforeach()
    set_property(TARGET caffe2::mkl PROPERTY INTERFACE_LINK_DIRECTORIES "${_shardema_kept_dirs}")
  endif()
endif()
