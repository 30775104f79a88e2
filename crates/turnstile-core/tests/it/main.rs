mod x {}
mod dispatch;
