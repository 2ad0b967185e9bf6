# shardema_set_warnings(<target>): the warning set every target of ours uses.
function(shardema_set_warnings target)
  target_compile_options(${target} PRIVATE -Wall -Wextra -Wno-unused-parameter)
endfunction()
