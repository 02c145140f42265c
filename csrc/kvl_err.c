/* kvl_err.c - names and messages of the error codes (see KVL_ERRNO_MAP). */
#include "kvl.h"

const char *kvl_err_name(int code) {
  switch (code) {
  case 0: return "OK";
  case KVL_INPROGRESS: return "INPROGRESS";
  case KVL_FINISHED: return "FINISHED";
#define KVL__ERR_NAME(name, val, msg) case KVL_##name: return "KVL_" #name;
    KVL_ERRNO_MAP(KVL__ERR_NAME)
#undef KVL__ERR_NAME
  default: return "KVL_UNKNOWN";
  }
}

const char *kvl_strerror(int code) {
  switch (code) {
  case 0: return "success";
  case KVL_INPROGRESS: return "in progress";
  case KVL_FINISHED: return "already finished";
#define KVL__ERR_MSG(name, val, msg) case KVL_##name: return msg;
    KVL_ERRNO_MAP(KVL__ERR_MSG)
#undef KVL__ERR_MSG
  default: return "unknown error";
  }
}
